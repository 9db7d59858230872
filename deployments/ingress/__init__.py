"""The Serve ingress deployment, in the ingress replica's process: it serves the HTTP API of
:mod:`deployments.api` and binds its Protocols to the stage deployments' handles and to the
application's residency board; it also starts this replica's job runner. The one room that imports
both FastAPI and Ray."""
