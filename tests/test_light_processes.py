"""The actors that do not compute start without torch or a model library.

Each deployed application starts a node ledger (per node), a residency board and a job queue actor,
each a fresh Python process that imports its actor's module and unpickles the messages it is sent.
torch alone is 1.0 s of CPU there on a quiet 2-core machine (3 s under load); an app deploy in the
test suite starts these while its stage replicas load. Each case here does in a fresh interpreter
what that process does: import the module, unpickle what the callers send it.
"""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.ledger.actor import LedgerConfig
from cluster.ledger.liveness import OwnerRef
from deployments.capacity.batch_state import BatchState
from deployments.jobs.queue import JobsArgs
from deployments.jobs.records import JobError, JobParams, ListOrder, new_job
from offload_core.host.budget import Lease
from offload_core.shared_store.files import StoreKey

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "transformers", "safetensors", "fastapi", "starlette")
CHILD = ("import importlib, json, pickle, sys\n"
         "module, messages = sys.argv[1], sys.stdin.buffer.read()\n"
         "importlib.import_module(module)\n"
         "pickle.loads(messages)\n"
         f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")

PROCESSES = {
    "the node ledger": ("cluster.ledger.actor", [
        OwnerRef("replica", "node", "actor", 1, 2.0), Lease("lease", "replica", 4096),
        StoreKey("model", "transformer", "float32", "digest")]),
    "the residency board": ("deployments.replica.board", [
        BatchState(2, 1.5, 4), b"a report, pickled by its replica", frozenset({"replica"})]),
    # The cluster tests' stand-in replicas (tests/cluster/replicas.py) lease through it: 13 processes in
    # tests/cluster/ledger/test_actor.py alone, 1.7 s of CPU each with torch, 0.56 s without.
    "a replica's view of the node ledger": ("cluster.replica.ledger_view", [LedgerConfig(heartbeat_s=0.5)]),
    "the job queue": ("deployments.jobs.actor", [
        JobsArgs(), new_job("video_1", "m", JobParams("a fox", None, 16, 16, 5, 4, 2, 5.0, 1, "1"), 0),
        JobError("generation_failed", "lost"), ListOrder("desc")]),
}


def heavy_modules_of(module: str, messages: list) -> list[str]:
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", CHILD, module], input=pickle.dumps(messages), env=env, cwd=REPO,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_an_actor_that_does_not_compute_imports_no_torch_nor_model_library_nor_http(process):
    module, messages = PROCESSES[process]
    assert heavy_modules_of(module, messages) == [], f"{process}'s process ({module}) imports them at start"
