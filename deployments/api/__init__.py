"""The HTTP API, in the ingress replica's process: FastAPI routes, request and response bodies, the
OpenAI error answers, the ASGI guard. One subpackage per endpoint family (``images``: OpenAI's images API;
``videos``: its Videos API and the synchronous video route); what they share beside them (``schemas``:
the common body and its checks; ``service``: the drive; ``rendering``; ``errors``). No Ray here: the routes
reach the stages and the board only through the Protocols in :mod:`deployments.api.seams`, which the ingress
binds to Serve."""
