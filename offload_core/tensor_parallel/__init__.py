"""Tensor parallelism, the engine's side: one component split over the ranks of a process group.

- ``plans``: which classes have a plan (diffusers' ``_tp_plan`` for FLUX.1 and Qwen-Image DiTs,
  transformers' for T5/umT5 encoders), loading one rank's slice, sharding in place, planning a rank
  on ``meta``;
- ``sharded``: what the rest of the engine asks of a sharded module (its DTensor parameters, their
  local bytes): never streamed by ``.data`` rebinding, never a host-resident table.

Run by each rank's process (a tensor-parallel replica's rank workers) and by whichever process plans.
The service's side (the rank actors, the replica that fans calls out to them) is
``deployments/replica/tensor_parallel/``.
"""
