"""``offload-serve``: the one command (a console script from pyproject.toml), run in the user's shell.

    offload-serve plan --model wan2.1-t2v-14b --gpu L4 --host-ram 64GiB [--picture plan.svg]
    offload-serve plan path/to/diffusers-folder --gpu L4 --host-ram 64GiB   # a local folder of a served family
    offload-serve serve configs/local.yaml      # loopback Ray head with token auth + the app; Ctrl-C stops both
    offload-serve demo                          # what `make demo` does
    offload-serve doctor [CONFIG]               # is this machine ready for CONFIG? (exit 1 on a blocker)
    offload-serve residency http://127.0.0.1:8000 [--token T | $OFFLOAD_SERVE_TOKEN] [--json]

Each subcommand has ``--help``. ``plan`` is offload_core's planner CLI (no Ray, no GPU needed).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

TOKEN_ENV = "OFFLOAD_SERVE_TOKEN"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload-serve", description="Diffusion pipelines served on GPUs too "
                                     "small to hold them: plan, serve, try, and look at a running service.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("plan", add_help=False, help="plan a pipeline for a GPU, without one (--help for options)")
    serve = commands.add_parser("serve", help="run a Serve config on a loopback Ray head with token auth; "
                                "Ctrl-C stops the service and the head",
                                description="Start a Ray head on 127.0.0.1 with token auth, deploy CONFIG's "
                                "applications as `serve run CONFIG` would, and serve until Ctrl-C or SIGTERM; "
                                "then delete the apps and stop the head (nothing of Ray is left running).")
    serve.add_argument("config", type=pathlib.Path, help="a Serve config file, e.g. configs/local.yaml")
    serve.add_argument("--port", type=int, help="HTTP port (default: the config's http_options.port)")
    commands.add_parser("demo", add_help=False, help="start the tiny service, make an image and a video, print "
                        "where the weights are, stop (--help for options)")
    commands.add_parser("doctor", add_help=False, help="check this machine for what a config needs: GPUs, driver, "
                        "locked memory, /dev/shm, host RAM, Ray's token, the model (--help for options)")
    residency = commands.add_parser("residency", help="a running service's residency report, for a terminal",
                                    description="GET URL/v1/residency and print, per replica, where its weights "
                                    "are (device and host tiers), its leases and its plan.")
    residency.add_argument("url", help="the service's base URL, e.g. http://127.0.0.1:8000")
    residency.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                           help=f"bearer token (default: ${TOKEN_ENV})")
    residency.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    # plan, demo and doctor keep their own parsers (and --help): everything after the command is theirs.
    if argv and argv[0] == "plan":
        from deployments.models import vae_tiling
        from offload_core.planner.cli import main as plan

        return plan(argv[1:], prog="offload-serve plan", tiles_by_default=vae_tiling.published)
    if argv and argv[0] == "demo":
        from deployments.dev import demo

        return demo.main(argv[1:], prog="offload-serve demo")
    if argv and argv[0] == "doctor":
        from deployments.dev import doctor

        return doctor.main(argv[1:], prog="offload-serve doctor")
    args = parser.parse_args(argv)
    if args.command == "serve":
        if not args.config.is_file():
            parser.error(f"serve: no config file {args.config}")
        from deployments.dev import doctor, serve_local
        from deployments.dev.local_ray import OBJECT_STORE_BYTES

        # The doctor's checks first (a second; only problems are printed): a blocker found now, not
        # minutes into start-up.
        if not doctor.preflight(args.config, OBJECT_STORE_BYTES):
            return 1
        return serve_local.main(args.config, args.port)
    return residency(args.url, args.token, args.json)


def residency(url: str, token: str | None, as_json: bool) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(url.rstrip("/") + "/v1/residency", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        print(f"offload-serve residency: {url}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"offload-serve residency: HTTP {response.status_code}: {response.text[:500]}", file=sys.stderr)
        return 1
    report = response.json()
    print(json.dumps(report, indent=2) if as_json else render_residency(report))
    return 0


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def render_residency(report: dict) -> str:
    """One block per replica: where its weights are by tier, its leases, its plan; then pending replicas."""
    lines = []
    for r in sorted(report.get("replicas", []), key=lambda r: (r["stage"], r["replica"])):
        totals = r["weights"]["totals"]
        leases = r.get("leases", {})
        lines.append(f"{r['stage']:<7} {r['replica']}  on {r['device']}, mode {r['mode']}")
        lines.append(f"  weights  device {_size(totals['device_bytes'])} | host pinned {_size(totals['host_pinned_bytes'])}"
                     f" (staging {_size(totals['host_staging_bytes'])}), pageable {_size(totals['host_pageable_bytes'])}, "
                     f"mapped {_size(totals['host_mapped_bytes'])}, shared {_size(totals['host_shared_bytes'])} | "
                     f"parked {_size(totals['parked_bytes'])}")
        lines.append(f"  device   predicted peak {_size(r['predicted_peak_bytes'])}, last call peak "
                     f"{_size(r['last_device_peak_bytes'])}, streamed {_size(r['last_bytes_streamed'])}; leases "
                     f"standing {_size(leases.get('standing_bytes', 0))}, reserved {_size(leases.get('reserved_bytes', 0))}"
                     + (f"; batch {r['batch']['size']}/{r['batch']['max']} (mean {r['batch']['mean']})"
                        if "batch" in r else ""))
        for c in r["weights"]["components"]:
            tiers = ", ".join(f"{n} {tier}" for tier, n in c["layer_tiers"].items() if n) or "none streamed"
            lines.append(f"  {c['name']:<14} layers: {tiers}")
        lines += [f"  plan     {line}" for line in r["plan"][:1]]
    for p in report.get("pending", []):
        lines.append(f"pending  {p['deployment']} {p['replica']}: waiting {p['waiting_s']:.0f} s: {p['reason']}")
    return "\n".join(lines) or "no replica has reported yet"


if __name__ == "__main__":
    sys.exit(main())
