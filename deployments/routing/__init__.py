"""Request routing for the stage deployments: Serve's request router that sends each Denoiser request
to the replica with the earliest predicted finish. Ray builds the router in every process that holds
a handle to the Denoiser (the ingress replicas; the mixed-fleet bench's driver), from the class path
``build_app`` puts in the deployment's ``request_router_config``; it reads the replicas' routing
stats (:mod:`deployments.capacity.replica_load`). No FastAPI here."""
