"""``offload-serve serve CONFIG``: a loopback Ray head with token auth, the config's apps on it, until Ctrl-C.

Ray is started as ``make demo`` starts it (:mod:`deployments.dev.local_ray`: ``RAY_AUTH_MODE=token``,
node address 127.0.0.1, dashboard on loopback, its own process group), and the config file is deployed
as ``serve run CONFIG`` deploys it (:func:`deployments.dev.demo.deploy`). Ctrl-C (or SIGTERM) deletes
the apps (each replica drains and gives back its leases and host weight stores), disconnects, then
stops the head, its processes and its address file: no ``serve.shutdown()``, whose controller kills
itself under its own ``graceful_shutdown`` call and leaves a red "killed by ray.kill" line behind.
"""
from __future__ import annotations

import logging
import os
import pathlib
import signal
import sys
import threading
import time

from deployments.dev import local_ray

logger = logging.getLogger(__name__)

OBJECT_STORE_BYTES = local_ray.OBJECT_STORE_BYTES


def main(config_path: pathlib.Path, port: int | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.update(local_ray.token_env())  # this driver and the head it starts: Ray's token auth
    import ray

    from deployments.dev.demo import deploy, load_config, wait_running

    config = load_config(config_path, port)
    names = [app.name for app in config.applications]
    stopped = threading.Event()
    # SIGTERM (a process manager's stop) ends the wait like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    ray_port = local_ray.free_port()
    head = local_ray.start_head(ray_port, OBJECT_STORE_BYTES, dict(os.environ))
    logger.info("Ray head at %s:%d (token auth, token in %s; dashboard on loopback)", local_ray.LOOPBACK, ray_port,
                local_ray.token_path(os.environ))
    try:
        ray.init(address=f"{local_ray.LOOPBACK}:{ray_port}", namespace="serve", log_to_driver=True)
        started = time.monotonic()
        deploy(config)
        for app in config.applications:
            wait_running(app.name)
            print(f"{app.name} serving at http://{config.http_options.host}:{config.http_options.port}"
                  f"{app.route_prefix} ({time.monotonic() - started:.1f} s); Ctrl-C stops it and its Ray head",
                  flush=True)
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping: deleting the applications, then the Ray head", flush=True)
        try:
            local_ray.stop_apps(names)
        finally:
            local_ray.stop_head(head)
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
