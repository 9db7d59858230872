"""A one-machine Ray head as ``make demo`` and ``make serve`` start it: token auth, loopback.

Ray 2.60's default is token authentication, but ``ray start`` quietly starts *without* it when
no token file exists yet, so the mode is set explicitly and the token generated first (in
``~/.ray/auth_token`` or ``$RAY_AUTH_TOKEN_PATH``, never in the repository). The node address
is 127.0.0.1 and the dashboard listens on loopback; Ray still binds some ports (GCS, raylet,
object manager, agents) to every interface, and the token is what refuses strangers there.
"""
from __future__ import annotations

import logging
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

from compat.ray import address_file as ray_address_file
from compat.ray import init_local_node

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 180  # a cold `ray start` takes ~15 s on an idle 2-core machine, minutes on a busy one
# The object store of the heads `make demo` and `offload-serve serve` start: the tiny zoo's tensors
# between stages are kilobytes; 200 MiB leaves room and spares the host (and /dev/shm).
OBJECT_STORE_BYTES = 200 * 1024 * 1024


def ray_executable() -> str:
    """The venv's ``ray`` beside this interpreter (``make`` never activates the venv)."""
    beside = pathlib.Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def token_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for every Ray process we start: token auth on, whatever the caller had."""
    env = dict(os.environ if base is None else base)
    env["RAY_AUTH_MODE"] = "token"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def token_path(env: dict[str, str]) -> pathlib.Path:
    """Where Ray reads the token: ``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    if env.get("RAY_AUTH_TOKEN_PATH"):
        return pathlib.Path(env["RAY_AUTH_TOKEN_PATH"])
    return pathlib.Path(env.get("HOME") or pathlib.Path.home()) / ".ray" / "auth_token"


def ensure_token(env: dict[str, str]) -> None:
    """Generate the cluster token if there is none, readable by this user only.

    (``ray get-auth-token --generate`` writes only ``~/.ray/auth_token`` and fails when
    ``RAY_AUTH_TOKEN_PATH`` names a file that does not exist yet.)"""
    if env.get("RAY_AUTH_TOKEN"):
        return
    path = token_path(env)
    if path.exists() and path.read_text().strip():
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, as Ray's own generator (uuid4 hex x2)


def use_token_auth() -> None:
    """Token auth for every Ray process this one starts, the token generated if there is none.

    Call it before ``import ray``: the driver reads ``RAY_AUTH_MODE`` when Ray is imported."""
    if "ray" in sys.modules and os.environ.get("RAY_AUTH_MODE") != "token":
        raise RuntimeError("use_token_auth() after `import ray`: the driver would run with another auth mode")
    os.environ.update(token_env())
    ensure_token(dict(os.environ))


def init_local(**init_kwargs) -> None:
    """``ray.init`` of a cluster of this process's own (benchmarks), as ``make demo`` runs Ray: token
    auth on (:func:`use_token_auth`, called before ``import ray``), the node address 127.0.0.1.

    ``address="local"`` never joins a cluster another process on this machine started; the token
    refuses strangers on the ports Ray still binds widely."""
    if os.environ.get("RAY_AUTH_MODE") != "token":
        raise RuntimeError("call local_ray.use_token_auth() before importing ray")
    init_local_node(LOOPBACK, **init_kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def head_command(port: int, dashboard_port: int, object_store_bytes: int, num_cpus: int | None = None,
                 temp_dir: str | None = None) -> list[str]:
    """``ray start`` for a loopback head that lives as long as this process (``--block``).

    No fixed port, so it starts beside another Ray on this machine (make test's own cluster runs while
    this head does, tests/conftest.py RAY_GROUPS): the dashboard agent's port is the kernel's (Ray's
    52365 taken, the agent retried 3-5 s before the raylet registered), and so is the Ray Client
    server's (Ray's 10001 taken, it exits, and ``--block`` stops the whole head; 0, which would turn it
    off, ``ray start`` refuses)."""
    command = [ray_executable(), "start", "--head", "--block", f"--node-ip-address={LOOPBACK}", f"--port={port}",
               f"--dashboard-host={LOOPBACK}", f"--dashboard-port={dashboard_port}", "--dashboard-agent-listen-port=0",
               f"--ray-client-server-port={free_port()}", f"--object-store-memory={object_store_bytes}",
               "--disable-usage-stats"]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus}")
    if temp_dir is not None:
        command.append(f"--temp-dir={temp_dir}")
    return command


class HeadProcess(subprocess.Popen):
    """``ray start --head --block`` for one head, in a process group of its own; it knows its GCS port
    and Ray's temp folder, so :func:`stop_head` can also take back the address file it wrote."""

    def __init__(self, command: list[str], port: int, temp_dir: str | None, **kwargs):
        super().__init__(command, **kwargs)
        self.port, self.temp_dir = port, temp_dir


def start_head(port: int, object_store_bytes: int, env: dict[str, str], num_cpus: int | None = None,
               temp_dir: str | None = None) -> HeadProcess:
    """Start the head and wait until its GCS accepts connections on loopback.

    Stop it with :func:`stop_head` (SIGTERM: ``ray start --block`` then stops its own processes,
    and no other Ray on this machine, unlike ``ray stop``)."""
    ensure_token(env)
    # Ray 2.60's `ray start --block` drains its node on SIGTERM, up to 30 s, for Serve to move replicas
    # elsewhere; this head is the only node and its apps are deleted before it stops, so the drain
    # only waited out its 30 s (Ctrl-C of `offload-serve serve` took 33 s; 0 turns it off).
    env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")}
    head = HeadProcess(head_command(port, free_port(), object_store_bytes, num_cpus, temp_dir), port, temp_dir,
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}")
        try:
            socket.create_connection((LOOPBACK, port), timeout=1).close()
            return head
        except OSError:
            time.sleep(0.5)
    stop_head(head)
    raise TimeoutError(f"Ray's GCS not listening on {LOOPBACK}:{port} after {START_TIMEOUT_S} s")


def stop_head(head: HeadProcess, timeout_s: float = 60) -> None:
    """Stop the head, then what it left: any process of its group, and Ray's address file naming it.

    ``ray start`` writes the head's address to ``ray_current_cluster`` in Ray's temp folder and only
    ``ray stop`` removes it; a head stopped by SIGTERM left it naming a dead head (with the node's
    address, not 127.0.0.1), and a plain ``serve run`` afterwards retried that head for minutes."""
    if head.poll() is None:
        head.terminate()
        try:
            head.wait(timeout_s)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
    _kill_group(head.pid)
    forget_address(head.port, head.temp_dir)


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of the head's process group (start_new_session: the group is only ours)."""
    import psutil

    left = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == pgid]
    if left:
        logger.info("Ray head stopped; %d of its processes were left (%s): killed", len(left),
                    ", ".join(str(p.pid) for p in left))
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:  # they ended between the look and the kill
            return


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def stop_apps(app_names) -> None:
    """Delete each app (replicas drain and release what they hold), then disconnect from Ray."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    for name in app_names:
        started = time.monotonic()
        serve.delete(name)
        logger.info("application %s deleted in %.1f s", name, time.monotonic() - started)
    ray.shutdown()


def address_file(temp_dir: str | None = None) -> pathlib.Path:
    """Ray's ``ray_current_cluster`` (where ``ray.init()`` and ``serve run`` look for a running head)."""
    return pathlib.Path(ray_address_file(temp_dir))


def forget_address(port: int, temp_dir: str | None = None) -> bool:
    """Remove Ray's address file if it names a head on ``port`` (ours, stopped); True if removed."""
    path = address_file(temp_dir)
    try:
        named = path.read_text().strip()
    except FileNotFoundError:
        return False
    if not named.endswith(f":{port}"):
        return False  # another head's (started after ours): not ours to remove
    path.unlink(missing_ok=True)
    logger.info("removed %s: it named the stopped head %s", path, named)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m deployments.dev.local_ray serve run configs/local.yaml``: start the loopback head,
    run the command against it (``RAY_ADDRESS`` names the head), stop the head when it ends."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--object-store-mib", type=int, default=200)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    env = token_env()
    port = free_port()
    head = start_head(port, args.object_store_mib * 1024 * 1024, env)
    env["RAY_ADDRESS"] = f"{LOOPBACK}:{port}"
    print(f"Ray head at {env['RAY_ADDRESS']} (token auth, token in {token_path(env)}; dashboard on loopback)",
          flush=True)
    try:
        command = args.command or ["serve", "run", "configs/local.yaml"]
        if command[0] == "serve":  # the venv's serve beside this interpreter, as for ray
            command[0] = str(pathlib.Path(ray_executable()).with_name("serve"))
        return subprocess.run(command, env=env).returncode
    except KeyboardInterrupt:
        return 130
    finally:
        stop_head(head)


if __name__ == "__main__":
    sys.exit(main())
