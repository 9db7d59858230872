"""tests/conftest.py's xdist scheduler: each Ray group starts first, on a worker of its own, and the
in-process modules fill in around it."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import RAY_GROUPS, RAY_MODULES, pytest_xdist_make_scheduler

# A collection as make test's: in-process tests before and after the Ray modules, one module with more
# tests than either group.
IN_PROCESS = [f"tests/offload_core/test_model{i // 25}.py::test_{i}" for i in range(200)] + [
    f"tests/offload_core/test_many.py::test_{i}" for i in range(len(RAY_GROUPS) * 100)]
RAY = [f"{module}::test_{i}" for group in RAY_GROUPS.values() for module in group for i in range(2)]
COLLECTION = IN_PROCESS[:100] + RAY + IN_PROCESS[100:]


class Worker:
    def __init__(self, name: str):
        self.gateway, self.shutting_down, self.sent = SimpleNamespace(id=name), False, []

    def send_runtest_some(self, indices):
        self.sent.append(list(indices))

    def shutdown(self):
        self.shutting_down = True


def _started(reorder: bool):
    """The scheduler of ``make test`` (``-n 2``) once both workers collected, and the two workers."""
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=reorder),
                             getvalue=lambda name: ["2*popen"] if name == "tx" else None)
    scheduler = pytest_xdist_make_scheduler(config, log=None)
    scheduler.log = lambda *args: None
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, COLLECTION)
    scheduler.schedule()
    return scheduler, workers


def _modules(indices) -> set[str]:
    return {COLLECTION[i].split("::")[0] for i in indices}


# xdist orders its queue by tests per unit unless --no-loadscope-reorder, which keeps the collection's.
@pytest.mark.parametrize("reorder", [True, False])
def test_the_ray_groups_start_first_each_whole_on_a_worker_of_its_own(reorder):
    _, workers = _started(reorder)
    firsts = [_modules(worker.sent[0]) for worker in workers]
    groups = [set(g) for g in RAY_GROUPS.values()]
    assert [first for first in firsts if first & RAY_MODULES] == groups[:len(workers)]
    assert all(not first & RAY_MODULES for first in firsts[len(groups):]), "the other worker runs in-process"


def test_a_worker_done_with_its_group_takes_whole_in_process_modules():
    scheduler, (first, _) = _started(reorder=True)
    done = 0
    while done < sum(map(len, first.sent)):  # the first worker runs all it is sent, the second nothing
        sent = [i for unit in first.sent for i in unit]
        for index in sent[done:]:
            scheduler.mark_test_complete(first, index)
        done = len(sent)
    units = first.sent[1:]
    assert len(units) > 1 and all(not _modules(unit) & RAY_MODULES for unit in units)
    for unit in units:
        (module,) = _modules(unit)
        assert unit == [i for i, nodeid in enumerate(COLLECTION) if nodeid.startswith(module + "::")], module


NICE_PROBE = """
import os, sys
from pathlib import Path
from types import SimpleNamespace
os.environ["PYTEST_XDIST_WORKER"] = "gw0"
import tests.conftest
tests.conftest.IN_PROCESS_NICE = int(sys.argv[2])  # above the niceness the probe starts with
tests.conftest.pytest_runtest_setup(SimpleNamespace(nodeid=sys.argv[1] + "::test_x"))
print(os.nice(0))
"""


def _niceness_after(module: str, nice: int) -> int:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NICE_PROBE, module, str(nice)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1], check=True)
    return int(done.stdout.split()[-1])


def test_an_xdist_worker_yields_the_cpu_from_its_first_in_process_test_and_a_ray_module_keeps_its_priority():
    import os

    mine = os.nice(0)  # this worker's own (already niced under make test's xdist)
    assert _niceness_after("tests/offload_core/test_model0.py", mine + 3) == mine + 3
    assert _niceness_after(sorted(RAY_MODULES)[0], mine + 3) == mine
