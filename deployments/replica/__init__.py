"""A stage replica's process: the three stage deployments (TextEncoder, Denoiser, VaeDecoder), each
wrapping one worker (load, plan, lease, warm up, run), the Denoiser's step batching, metrics, and
the residency board each replica publishes to (its actor is its own process). The per-family step
loop it batches (steppers) and the cancellation flag it checks live in :mod:`deployments.models`."""
