"""tests/conftest.py's xdist scheduler: each Ray group starts first, on a worker of its own, and the
in-process modules fill in around it."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import LONG_IN_PROCESS, RAY_GROUPS, RAY_MODULES, pytest_xdist_make_scheduler

# A collection as make test's: in-process tests before and after the Ray modules, one module with more
# tests than either group.
IN_PROCESS = [f"tests/offload_core/test_model{i // 25}.py::test_{i}" for i in range(200)] + [
    f"tests/offload_core/test_many.py::test_{i}" for i in range(len(RAY_GROUPS) * 100)]
IN_PROCESS_MODULES = {nodeid.split("::")[0] for nodeid in IN_PROCESS}
RAY = [f"{module}::test_{i}" for group in RAY_GROUPS.values() for module in group for i in range(2)]
COLLECTION = IN_PROCESS[:100] + RAY + IN_PROCESS[100:]


class Worker:
    def __init__(self, name: str):
        self.gateway, self.shutting_down, self.sent = SimpleNamespace(id=name), False, []

    def send_runtest_some(self, indices):
        self.sent.append(list(indices))

    def shutdown(self):
        self.shutting_down = True


def _started(reorder: bool, collection: list[str] = COLLECTION):
    """The scheduler of ``make test`` (``-n 2``) once both workers collected, and the two workers."""
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=reorder),
                             getvalue=lambda name: ["2*popen"] if name == "tx" else None)
    scheduler = pytest_xdist_make_scheduler(config, log=None)
    scheduler.log = lambda *args: None
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    return scheduler, workers


def _modules(indices, collection: list[str] = COLLECTION) -> set[str]:
    return {collection[i].split("::")[0] for i in indices}


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
from types import SimpleNamespace
if os.geteuid() == 0:  # start at nice 0 (others may not lower an inherited niceness)
    os.setpriority(os.PRIO_PROCESS, 0, 0)
os.environ["PYTEST_XDIST_WORKER"] = "gw0"
before = os.nice(0)
import tests.conftest
tests.conftest.pytest_runtest_setup(SimpleNamespace(nodeid=sys.argv[1] + "::test_x"))
print(before, os.nice(0))
"""


def _niceness(module: str) -> tuple[int, int]:
    """(niceness before, after) the hook ran for a test of ``module`` in a fresh process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NICE_PROBE, module], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1], check=True)
    before, after = map(int, done.stdout.split()[-2:])
    return before, after


def test_an_xdist_worker_yields_the_cpu_to_the_session_clusters_group_which_keeps_its_priority():
    import os

    from tests.conftest import CRITICAL_GROUP, IN_PROCESS_NICE

    assert _niceness("tests/offload_core/test_model0.py")[1] == IN_PROCESS_NICE
    assert _niceness("tests/deployments/dev/test_serve_command.py")[1] == IN_PROCESS_NICE, "its head too"
    before, after = _niceness(sorted(RAY_GROUPS[CRITICAL_GROUP])[0])
    assert after == before and (os.geteuid() != 0 or before == 0), (before, after)


def test_the_long_in_process_modules_come_right_after_the_groups_the_longest_first():
    """One test each, last in the collection: xdist alone would queue them last, and a run would end on one
    worker running a 25 s module while the other idled."""
    longest, *_, shortest = sorted(LONG_IN_PROCESS, key=lambda m: -LONG_IN_PROCESS[m])
    collection = COLLECTION + [f"{shortest}::test_it", f"{longest}::test_it"]
    scheduler, workers = _started(reorder=True, collection=collection)
    sent = [_modules(unit, collection) for worker in workers for unit in worker.sent]
    order = [modules for modules in sent if not modules & RAY_MODULES] + [{scope} for scope in scheduler.workqueue]
    assert order[:3] == [{longest}, {shortest}, order[2]] and order[2] <= IN_PROCESS_MODULES, order[:3]
