"""bench/suite_cpu.py: a run's CPU counted by process kind, daemons left behind by their starter included."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The command forks a child that forks a worker and exits at once (as `ray start` leaves its daemons): the
# worker, orphaned, burns 0.6 CPU-s, says so in a file and lingers; the command waits for the file, lets
# the bench sample a few more times, then exits 3. Not a fixed sleep: a worker at nice 19 beside the Ray
# tests got 0.2 CPU-s in the 1.2 s the command used to wait.
COMMAND = """
import os, sys, time
if os.fork() == 0:
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import os, time; t = time.process_time()\\n"
                                  "while time.process_time() - t < 0.6: pass\\n"
                                  "open(os.environ['ORPHAN_DONE'], 'w').close(); time.sleep(2)", "orphan-worker"])
    os._exit(0)
os.wait()
deadline = time.monotonic() + 50
while not os.path.exists(os.environ["ORPHAN_DONE"]) and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)
sys.exit(3)
"""


def test_an_orphaned_daemons_cpu_is_counted_and_the_commands_exit_status_is_kept(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "ORPHAN_DONE": str(tmp_path / "orphan-done")}
    done = subprocess.run([sys.executable, "bench/suite_cpu.py", "--every", "0.1", "--", sys.executable, "-c",
                           COMMAND], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["returncode"] == 3
    # The kinds are the command's first two words; the orphan's is "python -c" too, the only one that works.
    worked = report["kinds"]["python -c"]
    assert worked["processes"] >= 2 and worked["cpu_s"] >= 0.45, report
    assert report["cpu_s"] <= report["wall_s"] * 2 + 0.5
    # The machine's own counters span the run: its busy CPU holds the orphan's, the new processes faulted
    # their memory in, and the probe timed the cores at least once (at the start).
    assert report["machine_busy_cpu_s"] >= worked["cpu_s"] - 0.1, report
    assert report["page_faults"] > 1000 and report["steal_cpu_s"] >= 0 and report["disk_read_mib"] >= 0, report
    assert 0 < report["probe_ns_per_step"] < 10_000, report


class _Process:
    def __init__(self, title: str):
        self.title = title

    def cmdline(self):
        return self.title.split()

    def name(self):
        return "python"


def test_a_ray_process_counts_as_its_deployment_or_its_actor_class_whatever_its_name(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_cpu", REPO / "bench" / "suite_cpu.py")
    suite_cpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "suite_cpu", suite_cpu)  # its dataclass looks its module up there
    spec.loader.exec_module(suite_cpu)
    titles = {  # as Ray sets them: named actors are <name>:<class>, a running method is .<method>
        "ray::SERVE_REPLICA::svc-test#Ingress#vfmck8np:ServeReplica:svc-test:Ingress": "ray::Replica:Ingress",
        "ray::ServeReplica:svc-test:Denoiser.initialize_and_get_metadata": "ray::Replica:Denoiser",
        "ray::offload-ledger-67217b5631:NodeLedger": "ray::NodeLedger",
        "ray::offload-serve-jobs:svc-test:JobQueueActor": "ray::JobQueueActor",
        "ray::SERVE_CONTROLLER_ACTOR:ServeController": "ray::ServeController",
        "ray::RankWorker.call": "ray::RankWorker",
        "ray::IDLE": "ray::IDLE",
    }
    assert {title: suite_cpu.kind_of(_Process(title)) for title in titles} == titles
