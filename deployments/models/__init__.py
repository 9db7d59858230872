"""Model families: one module per family, each defining ``ADAPTERS`` (``deployments.models.adapter``);
``deployments.models.registry`` finds a folder's adapter, ``deployments.models.families`` is the one door
the rest of the service calls through; ``steppers`` is the step-batching interface the adapters
implement (with ``cancel``, the flag their step loops check), ``activation_features`` what each
family's activation memory is modelled on. Diffusers and torch only (no Ray, no FastAPI, no ``cluster``);
imported by the stage replicas, and by the ingress for the family's facts."""
