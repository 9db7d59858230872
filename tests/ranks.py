"""Rank processes for the in-process tests' gloo groups, forked from one forkserver per test process.

The tests that run 2 gloo ranks (offload_core's and the models' tensor parallelism, the host tables'
sharded table, the ranked denoiser) spawned each rank: a fresh interpreter that imported torch,
diffusers (which imports torch._dynamo), transformers and the service's worker again, about 5 CPU-s
per rank on this 2-core machine, ten ranks a run. Here the ranks fork from a multiprocessing
forkserver that imported them once (``PRELOAD``), as bench/host_memory.py's measured processes do;
each rank then imports only its test module. Runs in the test process (pytest or an xdist worker);
the server lives until that process ends.

A forked rank gets the server's environment, not the test's: the server starts with
``OMP_NUM_THREADS=1`` (one BLAS thread per rank on a shared machine), before torch is imported there.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

import torch.multiprocessing as mp

# What the ranks import, heaviest first (CPU-s in a fresh interpreter here): torch 1.5, diffusers 1.4-1.7
# (torch._dynamo), deployments.replica.worker 1.0 (ray.serve), transformers' T5 0.8, transformers 0.6-0.7.
# None of them starts a thread at import (the server forks; one thread after all of them).
PRELOAD = (
    "torch", "torch.distributed", "transformers", "diffusers",
    "transformers.models.t5.modeling_t5", "transformers.models.umt5.modeling_umt5",
    "diffusers.models.transformers.transformer_flux", "diffusers.models.transformers.transformer_qwenimage",
    "deployments.replica.worker",
)


def context() -> multiprocessing.context.ForkServerContext:
    """torch.multiprocessing's forkserver context (its queues share tensors as torch's do), the server
    started with ``PRELOAD`` imported."""
    os.environ["OMP_NUM_THREADS"] = "1"  # the server's environment is every rank's
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()
    return mp.get_context("forkserver")


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with the ranks forked from the preloaded server:
    ``fn(rank, *args)`` in each, joined; a rank's exception is raised here."""
    context()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
