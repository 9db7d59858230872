"""Tensor parallelism, the service's side: one stage replica over several GPUs.

- ``group``: the replica's rank actors in its placement group's bundles, every call to all of them
  in one order, rank 0's answer (run by the stage replica);
- ``ranked_denoiser``: the Denoiser replica at tp_size > 1: the step batcher here, the transformer's
  forward on the ranks.

A rank's place in its group (``deployments/replica/rank_spec.py``, plain data) stays beside the worker,
which every rank runs. The engine's side (plans, sharded modules) is ``offload_core/tensor_parallel/``.
"""
