"""How much the service can take: request limits and admission math (read by the ingress, enforced
by every stage replica), the GPU-share arithmetic of the deployments' fractions (pure, run by
``build_app`` in the driver), and the replicas Ray has not placed (read from Serve's controller by
the ingress)."""
