"""The OpenAI Videos API: jobs (``/v1/videos``), their edits (remix, ``/v1/videos/edits``) and extensions; and
this server's synchronous ``POST /v1/videos/generations``.

``protocol``: the video body every video request extends, and its checks; ``generations``: the synchronous
route; ``jobs``: the queued routes and one ingress replica's side of the queue; ``create``: ``POST /v1/videos``
bodies; ``edit_jobs``: the edit and extension calls; ``edits``: their bodies and parameters; ``uploads``: an
uploaded video checked before it is decoded in full. Run by the ingress replica (the runner is
``deployments.jobs``).
"""
