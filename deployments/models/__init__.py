"""Model families: one module per family, each defining ``ADAPTERS`` (``deployments.models.adapter``);
``deployments.models.registry`` finds a folder's adapter, ``deployments.models.families`` is the one door
the rest of the service calls through. Diffusers and torch only (no Ray, no FastAPI, no ``cluster``);
imported by the stage replicas, and by the ingress for the family's facts."""
