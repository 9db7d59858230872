"""``offload-serve doctor [CONFIG]``: is this machine ready for what a Serve config will need?

Run in the user's shell before a long start, and by ``make demo`` (``offload-serve demo``) before it
starts Ray, printing only the problems there. One row per check (:mod:`deployments.dev.doctor_checks`):
the GPUs and their free memory, the driver against torch's CUDA, the locked-memory limit against
the pin budget, ``/dev/shm`` against Ray's object store, host RAM and cgroup limits against the
per-replica host budgets, Ray's token, and the model each application serves. Exit status 1 when
any row is FAIL (a blocker), else 0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from deployments.dev import doctor_checks as checks
from deployments.dev.doctor_checks import Check, Machine, Status
from deployments.dev.doctor_config import ConfigError, ConfigNeeds, read_config
from deployments.dev.local_ray import OBJECT_STORE_BYTES
from offload_core.host.budget_cap import format_bytes, parse_host_budget

REPO = Path(__file__).resolve().parents[2]  # deployments/dev/doctor.py -> the repository
DEFAULT_CONFIG = REPO / "configs" / "local.yaml"


def run_checks(needs: ConfigNeeds, machine: Machine, creates_token: bool = False) -> tuple[Check, ...]:
    """Every check of ``needs`` against ``machine``; ``creates_token``: the caller generates Ray's token."""
    rows = [checks.check_gpus(needs, machine), checks.check_driver(needs, machine),
            checks.check_memlock(needs, machine), checks.check_shm(needs, machine),
            checks.check_host_ram(needs, machine), checks.check_ray_token(machine, creates_token)]
    rows += [checks.check_model(m.model_path, m.tiny_family) for m in needs.models]
    return tuple(rows)


def blocked(rows: Sequence[Check]) -> bool:
    return any(row.status is Status.FAIL for row in rows)


def render(rows: Sequence[Check]) -> str:
    """A table: check, status, what was found, and each problem's fix on the line below it."""
    width = max(len(row.name) for row in rows)
    lines = [f"{'check':<{width}}  {'status':<6}  found", f"{'-' * width}  ------  -----"]
    for row in rows:
        lines.append(f"{row.name:<{width}}  {row.status.value:<6}  {row.found}")
        if row.fix and row.status is not Status.OK:
            lines.append(f"{'':<{width}}  {'':<6}  fix: {row.fix}")
    return "\n".join(lines)


def _bytes(text: str) -> int:
    spec = parse_host_budget(text)
    if spec.nbytes is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 4GiB")
    return spec.nbytes


def main(argv: list[str] | None = None, prog: str | None = None, machine: Machine | None = None) -> int:
    """The CLI; ``machine`` replaces this machine's facts (tests simulate limits with it)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", type=Path, default=DEFAULT_CONFIG,
                        help="a Serve config file (default: configs/local.yaml)")
    parser.add_argument("--object-store", type=_bytes, default=OBJECT_STORE_BYTES,
                        help="Ray's object store size, e.g. 4GiB (default: the "
                        f"{format_bytes(OBJECT_STORE_BYTES)} of `offload-serve serve` and `make demo`)")
    args = parser.parse_args(argv)
    try:
        needs = read_config(args.config, args.object_store)
    except ConfigError as exc:
        parser.error(str(exc))
    rows = run_checks(needs, machine or checks.probe_machine(needs.object_store_bytes))
    print(f"offload-serve doctor: {args.config} on this machine")
    print(render(rows))
    if blocked(rows):
        print("\nFAIL: fix the rows above before starting; each says how.", file=sys.stderr)
        return 1
    return 0


def preflight(config: Path, object_store_bytes: int, machine: Machine | None = None) -> bool:
    """``make demo``'s first step: the checks, printing only the problems (WARN, FAIL) to stderr;
    False when one is a blocker. The demo creates Ray's token itself, so a missing one is none."""
    needs = read_config(config, object_store_bytes)
    rows = run_checks(needs, machine or checks.probe_machine(object_store_bytes), creates_token=True)
    problems = [row for row in rows if row.status is not Status.OK]
    if problems:
        print(f"offload-serve doctor ({config}):\n{render(problems)}", file=sys.stderr)
    return not blocked(rows)
