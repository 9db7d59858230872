"""OpenAI's images API: ``POST /v1/images/generations`` and ``POST /v1/images/edits``.

``protocol``: the request body and its checks; ``generations``: the generation route; ``edits``: the edit
route (an image, and a mask to inpaint), run as diffusers' img2img. Run by the ingress replica.
"""
