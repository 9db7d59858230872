"""The HTTP API, in the ingress replica's process: FastAPI routes, request and response bodies, the
OpenAI error answers, the ASGI guard. No Ray here: the routes reach the stages and the board only
through the Protocols in :mod:`deployments.api.seams`, which the ingress binds to Serve."""
