"""Ray as `make demo` starts it refuses a driver without the token, even on the node's other address.

A second Ray, in its own processes and temp dir, with token auth (the session's test cluster runs
with RAY_AUTH_MODE=disabled, which is only ever set inside tests/conftest.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import psutil
import pytest

from deployments.dev import local_ray
from tests.waiting import wait_for

# Connecting fails fast when the GCS refuses; a driver that is let in runs one task.
DRIVER = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print("ANSWER", ray.get(ray.remote(lambda: 6 * 7).remote()))
"""


def _non_loopback_ipv4() -> str:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == 2 and not address.address.startswith("127."):
                return address.address
    raise AssertionError("this machine has no non-loopback IPv4 address: the lockdown cannot be checked here")


def _driver(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DRIVER, address], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def locked_head():
    """(the head's non-loopback GCS address, its token file, env, the head, its temp dir) for a head
    started as `make demo` and the benches start it."""
    outside = _non_loopback_ipv4()
    scratch = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    token = os.path.join(scratch, "auth_token")
    env = local_ray.token_env({k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")})
    env["RAY_AUTH_TOKEN_PATH"] = token
    port = local_ray.free_port()
    head = local_ray.start_head(port, 100 * 1024 * 1024, env, num_cpus=1, temp_dir=scratch)
    try:
        yield f"{outside}:{port}", token, env, head, scratch
    finally:
        local_ray.stop_head(head)


def test_a_driver_without_the_token_is_refused_on_the_non_loopback_address(locked_head):
    address, _, env, *_ = locked_head
    stranger = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    # Two connection attempts, not Ray's 20 (one a second): a refusal is final, and 20 took 20 s here.
    stranger.update(RAY_AUTH_MODE="disabled", HOME=tempfile.mkdtemp(prefix="stranger"), RAY_NUM_REDIS_GET_RETRIES="2")
    refused = _driver(address, stranger)
    assert refused.returncode != 0 and "ANSWER" not in refused.stdout, refused.stdout[-2000:]
    assert "authenticat" in (refused.stdout + refused.stderr).lower(), refused.stderr[-2000:]


def test_a_driver_with_the_token_gets_in_so_the_refusal_was_the_tokens_doing(locked_head):
    address, token, env, *_ = locked_head
    admitted = _driver(address, env)
    assert "ANSWER 42" in admitted.stdout, admitted.stderr[-2000:]
    assert open(token).read().strip(), "the token file is empty"


def _ray_processes_of(scratch: str) -> list[str]:
    """Processes whose command line names the head's temp dir (GCS, raylet, agents, workers)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(process.info["cmdline"] or ())
        if scratch in line:
            found.append(f"{process.info['pid']}: {line[:120]}")
    return found


def test_stopping_the_head_leaves_no_address_file_naming_it_and_no_ray_process(locked_head):
    # Last in this module: it stops the module's head itself (the fixture's stop is then a no-op).
    _, _, _, head, scratch = locked_head
    address_file = local_ray.address_file(scratch)
    # `ray start` writes it once every process it starts is up, after the GCS already accepted connections.
    wait_for(address_file.exists, 120, "ray start to write its address file")
    assert address_file.read_text().strip().endswith(f":{head.port}"), "ray start wrote the head's address"
    assert _ray_processes_of(scratch), "the head's processes name its temp dir"
    local_ray.stop_head(head)
    assert not address_file.exists(), f"{address_file} still names the stopped head: {address_file.read_text()}"
    assert _ray_processes_of(scratch) == []


def test_an_address_file_naming_another_head_is_left_alone(tmp_path):
    (tmp_path / "ray_current_cluster").write_text("10.0.0.7:6380")
    assert local_ray.forget_address(6379, str(tmp_path)) is False
    assert (tmp_path / "ray_current_cluster").read_text() == "10.0.0.7:6380"
    assert local_ray.forget_address(6380, str(tmp_path)) is True
    assert not (tmp_path / "ray_current_cluster").exists()
