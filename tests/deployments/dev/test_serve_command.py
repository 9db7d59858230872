"""`offload-serve serve CONFIG` end to end: it serves, its Ray head refuses a driver without the token even
on the node's other address, and Ctrl-C stops the app and its Ray head cleanly.

The module's one app, in its own Ray head (token auth, as users run it), in a temp dir of its own so
what it leaves (Ray's address file, processes naming that dir) can be checked. The lockdown is checked
on this head (not one of its own: each head costs seconds to start and stop); the session's test
cluster runs with RAY_AUTH_MODE=disabled, which is only ever set inside tests/conftest.py.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from deployments.dev import local_ray
from tests.conftest import free_port
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[3]
# What must never appear in a clean run's output (Ray's red task failures, Python tracebacks).
ERROR_LINES = re.compile(r"Traceback|killed by `?ray\.kill|graceful_shutdown failed|ERROR|Unhandled error")
HEAD = re.compile(r"Ray head at 127\.0\.0\.1:(\d+) ")
# Connecting fails fast when the GCS refuses; a driver that is let in runs one task (no CPU: the app's
# replicas hold 1.25 of the head's 2).
DRIVER = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print("ANSWER", ray.get(ray.remote(num_cpus=0)(lambda: 6 * 7).remote()))
"""


@dataclass
class Served:
    server: subprocess.Popen
    port: int  # HTTP
    scratch: str  # RAY_TMPDIR: Ray's temp dir is <scratch>/ray
    token: Path
    env: dict[str, str]
    output: list[str] = field(default_factory=list)

    @property
    def ray_port(self) -> int:
        return int(next(m.group(1) for line in self.output if (m := HEAD.search(line))))

    @property
    def address_file(self) -> Path:
        return local_ray.address_file(str(Path(self.scratch, "ray")))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`offload-serve serve configs/local.yaml` once it reported it serves; killed at the end if a test
    left it running (the last test stops it with Ctrl-C)."""
    scratch = tempfile.mkdtemp(prefix="os", dir="/tmp")  # Ray's temp dir: socket paths must fit 107 bytes
    token = tmp_path_factory.mktemp("token") / "auth_token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_TMPDIR=scratch, RAY_AUTH_TOKEN_PATH=str(token), OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    script = str(Path(sys.executable).with_name("offload-serve"))
    port = free_port()
    # SIGINT as a terminal leaves it: a suite started in the background by a non-interactive shell (`make
    # test &`, nohup) ignores SIGINT, the command inherits that, Python then installs no KeyboardInterrupt
    # handler, and Ctrl-C below went unanswered for 300 s.
    server = subprocess.Popen([script, "serve", "configs/local.yaml", "--port", str(port)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    served = Served(server, port, scratch, token, env)
    try:
        def serving():
            line = server.stdout.readline()
            served.output.append(line)
            assert line or server.poll() is None, "".join(served.output)[-3000:]
            return "serving at" in line

        wait_for(serving, 600, "offload-serve serve to report it serves", poll_s=0)
        yield served
    finally:
        if server.poll() is None:
            server.kill()
        elif server.returncode == 0:  # stopped cleanly (and checked): its Ray logs are of no more use
            shutil.rmtree(scratch, ignore_errors=True)


def test_it_serves_health_on_the_asked_port(served):
    health = httpx.get(f"http://127.0.0.1:{served.port}/health", timeout=30)
    assert health.status_code == 200, health.text


def _non_loopback_ipv4() -> str:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == 2 and not address.address.startswith("127."):
                return address.address
    raise AssertionError("this machine has no non-loopback IPv4 address: the lockdown cannot be checked here")


def _driver(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DRIVER, address], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_driver_without_the_token_is_refused_on_the_non_loopback_address(served):
    stranger = {k: v for k, v in served.env.items() if not k.startswith("RAY_AUTH")}
    # Two connection attempts, not Ray's 20 (one a second): a refusal is final, and 20 took 20 s here.
    stranger.update(RAY_AUTH_MODE="disabled", HOME=tempfile.mkdtemp(prefix="stranger"), RAY_NUM_REDIS_GET_RETRIES="2")
    refused = _driver(f"{_non_loopback_ipv4()}:{served.ray_port}", stranger)
    assert refused.returncode != 0 and "ANSWER" not in refused.stdout, refused.stdout[-2000:]
    assert "authenticat" in (refused.stdout + refused.stderr).lower(), refused.stderr[-2000:]


def test_a_driver_with_the_token_gets_in_so_the_refusal_was_the_tokens_doing(served):
    admitted = _driver(f"{_non_loopback_ipv4()}:{served.ray_port}", local_ray.token_env(served.env))
    assert "ANSWER 42" in admitted.stdout, admitted.stderr[-2000:]
    assert served.token.read_text().strip(), "the token file is empty"


def _ray_processes_of(scratch: str) -> list[str]:
    """The head's processes, and only its: those whose command line or environment names its temp dir.

    The environment too, since a Ray worker retitles itself (``ray::IDLE``, ``ray::ServeReplica:...``) and
    its command line then names nothing; every process of the head inherits ``RAY_TMPDIR`` from it. Other
    Ray clusters on this machine (make test's other worker's, a helper's) name other folders."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(process.info["cmdline"] or ())
        try:
            named = scratch in line or process.environ().get("RAY_TMPDIR") == scratch
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone meanwhile, or another user's
            continue
        if named:
            found.append(f"{process.info['pid']}: {line[:120]}")
    return found


def test_ctrl_c_stops_it_without_error_lines_or_anything_of_ray_left(served):
    """Last: it stops the module's server."""
    assert served.address_file.read_text().strip().endswith(f":{served.ray_port}"), "ray start wrote the head's address"
    assert _ray_processes_of(served.scratch), "the head's processes name its temp dir"
    served.server.send_signal(signal.SIGINT)  # what Ctrl-C sends
    rest, _ = served.server.communicate(timeout=300)
    served.output.append(rest)
    text = "".join(served.output)
    assert served.server.returncode == 0, text[-3000:]
    assert "stopped" in text
    assert not [line for line in text.splitlines() if ERROR_LINES.search(line)], text[-3000:]
    assert not served.address_file.exists(), "Ray's address file names the stopped head"
    time.sleep(1)
    assert _ray_processes_of(served.scratch) == [], "Ray processes left behind"
