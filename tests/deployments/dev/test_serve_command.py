"""`offload-serve serve CONFIG` end to end: it serves, and Ctrl-C stops the app and its Ray head cleanly.

The module's one app, in its own Ray head (token auth, as users run it), in a temp dir of its own so
what it leaves (Ray's address file, processes naming that dir) can be checked.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from tests.conftest import free_port
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[3]
# What must never appear in a clean run's output (Ray's red task failures, Python tracebacks).
ERROR_LINES = re.compile(r"Traceback|killed by `?ray\.kill|graceful_shutdown failed|ERROR|Unhandled error")


def test_serve_answers_and_ctrl_c_stops_it_without_error_lines_or_anything_of_ray_left(tmp_path):
    scratch = tempfile.mkdtemp(prefix="os", dir="/tmp")  # Ray's temp dir: socket paths must fit 107 bytes
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_TMPDIR=scratch, RAY_AUTH_TOKEN_PATH=str(tmp_path / "auth_token"), OMP_NUM_THREADS="1",
               RAY_USAGE_STATS_ENABLED="0")
    script = str(Path(sys.executable).with_name("offload-serve"))
    server = subprocess.Popen([script, "serve", "configs/local.yaml", "--port", str(port)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    try:
        def serving():
            line = server.stdout.readline()
            output.append(line)
            assert line or server.poll() is None, "".join(output)[-3000:]
            return "serving at" in line

        wait_for(serving, 600, "offload-serve serve to report it serves", poll_s=0)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.status_code == 200, health.text
        server.send_signal(signal.SIGINT)  # what Ctrl-C sends
        rest, _ = server.communicate(timeout=300)
        output.append(rest)
    finally:
        if server.poll() is None:
            server.kill()
    text = "".join(output)
    assert server.returncode == 0, text[-3000:]
    assert "stopped" in text
    assert not [line for line in text.splitlines() if ERROR_LINES.search(line)], text[-3000:]
    assert not Path(scratch, "ray", "ray_current_cluster").exists(), "Ray's address file names the stopped head"
    time.sleep(1)
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"]) if scratch in " ".join(p.info["cmdline"] or ())]
    assert left == [], f"Ray processes left behind: {left}"
