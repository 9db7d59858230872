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
    """(the head's non-loopback GCS address, its token file) for a head started as `make demo` does."""
    outside = _non_loopback_ipv4()
    scratch = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    token = os.path.join(scratch, "auth_token")
    env = local_ray.token_env({k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")})
    env["RAY_AUTH_TOKEN_PATH"] = token
    port = local_ray.free_port()
    head = local_ray.start_head(port, 100 * 1024 * 1024, env, num_cpus=1, temp_dir=scratch)
    try:
        yield f"{outside}:{port}", token, env
    finally:
        local_ray.stop_head(head)


def test_a_driver_without_the_token_is_refused_on_the_non_loopback_address(locked_head):
    address, _, env = locked_head
    stranger = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    stranger.update(RAY_AUTH_MODE="disabled", HOME=tempfile.mkdtemp(prefix="stranger"))
    refused = _driver(address, stranger)
    assert refused.returncode != 0 and "ANSWER" not in refused.stdout, refused.stdout[-2000:]
    assert "authenticat" in (refused.stdout + refused.stderr).lower(), refused.stderr[-2000:]


def test_a_driver_with_the_token_gets_in_so_the_refusal_was_the_tokens_doing(locked_head):
    address, token, env = locked_head
    admitted = _driver(address, env)
    assert "ANSWER 42" in admitted.stdout, admitted.stderr[-2000:]
    assert open(token).read().strip(), "the token file is empty"
