"""A stage replica's process: the three stage deployments (TextEncoder, Denoiser, VaeDecoder), each
wrapping one worker (load, plan, lease, warm up, run), the Denoiser's step batching and steppers,
cancellation at step boundaries, metrics, and the residency board each replica publishes to."""
