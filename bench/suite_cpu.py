"""Where a test run's CPU goes: every process a command starts, sampled while it runs, CPU-s by kind.

The whole suite (``make test``: pytest -n 2 on 2 cores) is CPU-bound: its wall time is about the CPU all
its processes spend, halved, plus what the two cores leave idle. This runs a command (by default ``make
test``'s pytest line) and, every ``--every`` seconds, reads each process's CPU time (user + sys) with
psutil, for the command and every process it started (this process is their subreaper, so Ray's daemons,
which their starter leaves behind, stay in the tree); a process is counted by what it is: a Ray actor or
Serve replica by its title (``ray::ServeReplica:<app>:<Denoiser>`` counts as ``Replica:Denoiser``),
Ray's own daemons by name, pytest's xdist workers, multiprocessing children, anything else by its
command. Other processes on the machine are left out, but they still take the cores: run it on an
otherwise idle machine and say the load average (printed). A process that lives less than one sample is
missed, and one that exits is counted at its last sample (at most ``--every`` s of CPU short each).
The machine's own counters are read at the start and the end too: what every process on the machine
spent, the time the hypervisor took from this VM's cores (steal: no process is charged for it, but the
run waited through it), the cores' time idle waiting on the disk, and what was read from the disk (a
file the kernel evicted from the page cache is read again); every ``--probe-every`` seconds a fixed loop
times the cores' plain speed. Prints the kinds by CPU-s with how many processes each had, then one JSON
object: the command's exit status, wall seconds, total CPU-s, the machine's busy, steal and iowait CPU-s,
the MiB read from disk, the probe's median, and the kinds.

    .venv/bin/python bench/suite_cpu.py                       # make test's pytest line
    .venv/bin/python bench/suite_cpu.py -- .venv/bin/python -m pytest -q tests/cluster
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

SUITE = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "tests"]
RAY_DAEMONS = ("raylet", "gcs_server")
RAY_SCRIPTS = {"dashboard/agent.py": "dashboard_agent", "runtime_env/agent": "runtime_env_agent",
               "log_monitor": "log_monitor", "dashboard.py": "dashboard", "monitor.py": "monitor"}


PROVISIONAL = ("ray::untitled", "ray::IDLE")


@dataclass
class Seen:
    kind: str
    cpu_s: float


def kind_of(process: psutil.Process) -> str | None:
    """What ``process`` is, for counting; None for a process without a command line (a kernel thread)."""
    try:
        cmd, name = " ".join(process.cmdline()), process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if not cmd:
        return None
    if name in RAY_DAEMONS:
        return name
    replica = re.search(r"ServeReplica:[^:\s]+:(\w+)", cmd)
    if replica:  # ray::SERVE_REPLICA::<app>#<deployment>#<id>:ServeReplica:<app>:<deployment>[.<method>]
        return f"ray::Replica:{replica.group(1)}"
    title = re.search(r"ray::(\S+)", cmd)
    if title:  # the actor's class (or IDLE): a named actor's title is <name>:<class>[.<method>]
        return "ray::" + title.group(1).split(".")[0].split(":")[-1]
    if "default_worker.py" in cmd:
        return "ray::untitled"  # a Ray worker before it took its actor's title
    for script, kind in RAY_SCRIPTS.items():
        if script in cmd:
            return kind
    if "exec(eval(sys" in cmd:
        return "xdist worker"
    if "multiprocessing" in cmd:
        return "multiprocessing child"
    if "pytest" in cmd:
        return "pytest"
    return cmd.split()[0].rsplit("/", 1)[-1] + (" " + cmd.split()[1].rsplit("/", 1)[-1] if " " in cmd else "")


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def machine_counters() -> tuple[float, float, float, float, int]:
    """(busy, steal, iowait) CPU-s of the whole machine since boot (/proc/stat's first line), the MiB it
    read from disk (/proc/vmstat's pgpgin, in KiB: a file evicted from the page cache is read again) and
    its page faults (every new process faults in the memory it touches: 3.3 us a 4 KiB page here)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, iowait, irq, softirq, steal = fields[:8]
    with open("/proc/vmstat") as f:
        counters = dict(line.split() for line in f)
    return ((user + nice + system + irq + softirq) / tick, steal / tick, iowait / tick,
            int(counters["pgpgin"]) / 1024, int(counters["pgfault"]))


def probe_ns_per_add(adds: int = 200_000) -> float:
    """CPU nanoseconds this process takes per step of a fixed pure-Python loop: how fast a core runs plain
    Python now.

    The same suite's CPU-s can move between runs with every kind of process alike; sampled through a run,
    this says whether the cores' plain speed moved with it (docs/benchmarks.md has the runs it explained)."""
    start, total = time.process_time_ns(), 0
    for i in range(adds):
        total += i
    return (time.process_time_ns() - start) / adds


def become_subreaper() -> None:
    """Orphans of the command (``ray start``'s daemons) become this process's children, not init's."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def sample(seen: dict[tuple[int, float], Seen]) -> None:
    for process in psutil.Process().children(recursive=True):
        try:
            key, times = (process.pid, process.create_time()), process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        known = seen.get(key)
        # A Ray worker takes its actor's title after it starts (untitled, then IDLE, then the actor's):
        # read the kind again until it is an actor's.
        kind = known.kind if known and known.kind not in PROVISIONAL else kind_of(process)
        if kind is not None:
            seen[key] = Seen(kind, times.user + times.system)


def reap(command_pid: int) -> int | None:
    """Reap every exited child (orphans too, as their subreaper); the command's exit status once it exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        if pid == command_pid:
            return os.waitstatus_to_exitcode(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--probe-every", type=float, default=5.0, help="seconds between probes of the cores' speed")
    parser.add_argument("command", nargs="*", help="the command to run (after --); make test's pytest by default")
    args = parser.parse_args()
    command = args.command or SUITE
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()
    become_subreaper()
    machine_before = machine_counters()
    start, seen, probes, next_probe = time.monotonic(), {}, [], 0.0
    child = subprocess.Popen(command, env=env)
    returncode = None
    while returncode is None:
        sample(seen)
        if time.monotonic() >= next_probe:
            probes.append(probe_ns_per_add())
            next_probe = time.monotonic() + args.probe_every
        time.sleep(args.every)
        returncode = reap(child.pid)
    wall = time.monotonic() - start
    busy, steal, iowait, read_mib, faults = (after - before for after, before in zip(machine_counters(), machine_before))
    by_kind, count = collections.Counter(), collections.Counter()
    for entry in seen.values():
        by_kind[entry.kind] += entry.cpu_s
        count[entry.kind] += 1
    for kind, cpu in by_kind.most_common():
        print(f"{cpu:8.1f} CPU-s  {count[kind]:4d} processes  {kind}")
    total = sum(by_kind.values())
    print(f"total {total:.1f} CPU-s in {wall:.1f} s wall ({total / wall:.2f} cores busy on average); "
          f"load average at the start {load[0]:.2f}")
    print(f"the machine: {busy:.1f} CPU-s busy (all processes), {steal:.1f} CPU-s stolen by the hypervisor, "
          f"{iowait:.1f} CPU-s idle waiting on disk, {read_mib:.0f} MiB read from disk, {faults / 1e6:.1f} M page faults")
    probe = statistics.median(probes)  # the loop's first pass probes: never empty
    quartiles = statistics.quantiles(probes, n=4) if len(probes) > 1 else [probe] * 3
    print(f"the cores' speed: a fixed loop took {probe:.0f} ns a step (median of {len(probes)} probes; "
          f"quartiles {quartiles[0]:.0f} to {quartiles[2]:.0f})")
    print(json.dumps({"returncode": returncode, "wall_s": round(wall, 1), "cpu_s": round(total, 1),
                      "load_at_start": round(load[0], 2), "cores_busy": round(total / wall, 2),
                      "machine_busy_cpu_s": round(busy, 1), "steal_cpu_s": round(steal, 1),
                      "iowait_cpu_s": round(iowait, 1), "disk_read_mib": round(read_mib), "page_faults": faults,
                      "probe_ns_per_step": round(probe, 1),
                      "kinds": {k: {"cpu_s": round(v, 1), "processes": count[k]} for k, v in by_kind.most_common()}}))


if __name__ == "__main__":
    main()
