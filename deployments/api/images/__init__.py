"""OpenAI's images API: ``POST /v1/images/generations``, ``/v1/images/edits`` and ``/v1/images/variations``.

``protocol``: the request body and its checks; ``generations``: the generation route; ``edits``: the edit
route (an image, and a mask to inpaint), run as diffusers' img2img; ``variations``: DALL·E 2's variations,
refused by name (no family here has an image-variation pipeline). Run by the ingress replica.
"""
