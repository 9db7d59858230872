"""What a deployed app costs while it does nothing: CPU-s per process of the tests' shared tiny-Wan app.

Starts the tests' own Ray cluster (``tests.conftest.local_cluster``: its metrics interval, no log
monitor, Serve's controller loop) and deploys the app the Ray tests share
(``tests.deployments.conftest.deploy_shared``), then reads every process of that cluster (psutil: user +
sys) when the deploy returns and again after ``--idle-s`` with no request. Each process is named by its
Ray title (``ServeReplica:svc-test:Ingress``, ``ServeController``, ``JobQueueActor``) or its program
(``raylet``, ``gcs_server``). Prints the deploy's CPU and the idle CPU by process, then one JSON object.
Run it on an otherwise idle machine and compare checkouts side by side, as ratios.

    .venv/bin/python bench/idle_app.py --idle-s 30
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import conftest as test_cluster  # noqa: E402  (sets the tests' Ray environment first)
from tests.deployments import conftest as shared_app  # noqa: E402


def processes(cluster) -> list[psutil.Process]:
    """This process, the cluster's daemons and all their descendants (the workers)."""
    roots = [psutil.Process()]
    for infos in cluster.head_node.all_processes.values():
        for info in infos:
            try:
                roots.append(psutil.Process(info.process.pid))
            except psutil.NoSuchProcess:
                continue
    found = {}
    for root in roots:
        found[root.pid] = root
        try:
            found.update((child.pid, child) for child in root.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def cpu_by_process(cluster) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU-s so far)."""
    out = {}
    for process in processes(cluster):
        try:
            cmd, times = " ".join(process.cmdline()), process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        title = re.search(r"ray::(\S+)", cmd)
        out[process.pid] = (title.group(1).split(".")[0] if title else process.name(), times.user + times.system)
    return out


def spent(after: dict, before: dict) -> dict[str, float]:
    """CPU-s each process spent between two readings, by name (processes of one name summed)."""
    by_name: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        by_name[name] = by_name.get(name, 0.0) + cpu - before.get(pid, (name, 0.0))[1]
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=30.0, help="seconds the app idles while measured")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[shared_app.TOKEN_ENV] = shared_app.TOKEN
    load = os.getloadavg()[0]
    with test_cluster.local_cluster() as cluster:
        shared_app.serve_base_url(cluster)
        start, started = cpu_by_process(cluster), time.monotonic()
        shared_app.deploy_shared()
        deployed, deploy_s = cpu_by_process(cluster), time.monotonic() - started
        time.sleep(args.idle_s)
        idle = spent(cpu_by_process(cluster), deployed)
        deploy = spent(deployed, start)
    print(f"deploy: {deploy_s:.1f} s, {sum(deploy.values()):.2f} CPU-s")
    print(f"idle {args.idle_s:g} s, CPU-s by process:")
    for name, cpu in idle.items():
        print(f"  {cpu:6.2f}  {name}")
    print(f"load average at the start {load:.2f}")
    print(json.dumps({"idle_s": args.idle_s, "idle_cpu_s": round(sum(idle.values()), 2), "deploy_s": round(deploy_s, 1),
                      "deploy_cpu_s": round(sum(deploy.values()), 2), "load_at_start": round(load, 2),
                      "idle_by_process": {name: round(cpu, 2) for name, cpu in idle.items()}}))


if __name__ == "__main__":
    main()
