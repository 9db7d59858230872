"""Model families: which components each stage loads, how each runs its part of the pipeline, and the
features its activation memory is modelled on. Diffusers and torch only (no Ray, no FastAPI, no
``cluster``); imported by the stage replicas, and by the ingress for the family's facts."""
