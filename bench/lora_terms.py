"""The low-rank terms' cost in one forward: offload_core.lora.terms against the per-group arithmetic.

The medium Wan transformer (resident, 1 thread, as a Ray replica without CPUs runs), 8 rows (4
requests, guided) each with one of 4 rank-16 adapters on every attention and feed-forward Linear,
at bench/lora.py's shape (16x16 images: 1 latent token, cross-attention over 512 text tokens).
Interleaved forwards of three kinds: no adapters; the adapters through ``add_terms`` as shipped;
the adapters through the per-group arithmetic it replaced (per group: gather the rows, two matmuls,
multiply the output-wide term by the scaling, ``index_add_`` it back). Figures: each kind's median
forward over the one without adapters.

    .venv/bin/python bench/lora_terms.py [--forwards 20]

Last line: one JSON object (``in_place_over_base``, ``per_group_over_base``); no target of its own
(bench/lora.py holds the step target), so it always exits 0.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import lora as step_bench  # noqa: E402

import offload_core.lora.apply as lora_apply  # noqa: E402
from deployments.models import families  # noqa: E402
from deployments.wire.spec import PipelineStage  # noqa: E402
from offload_core.lora import apply_lora  # noqa: E402
from offload_core.lora.terms import add_terms  # noqa: E402
from zoo.tiny import ensure_medium_wan  # noqa: E402

ROWS = 8


def per_group(x: torch.Tensor, out: torch.Tensor, groups) -> torch.Tensor:
    """The arithmetic before offload_core/lora/terms.py: one gather, two matmuls, an output-wide
    multiply and one scatter per group (PEFT's order)."""
    for group in groups:
        rows = x if group.all_rows else x.index_select(0, group.rows)
        term = F.linear(F.linear(rows, group.a), group.b) * group.scaling
        if group.all_rows:
            out.add_(term)
        else:
            out.index_add_(0, group.rows, term)
    return out


def measure(forwards: int) -> dict:
    facts = families.read_family_traits(ensure_medium_wan())
    transformer = families.load_stage_pipeline(facts, PipelineStage.DENOISE, torch.float32).transformer
    adapters = step_bench.adapters_for(transformer, 16)
    loras = apply_lora(transformer, "cpu", sum(a.nbytes for a in adapters))
    for adapter in adapters:
        loras.load(adapter)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(ROWS, 16, 1, 2, 2, generator=generator)
    text = torch.randn(ROWS, 512, transformer.config.text_dim, generator=generator)
    timestep = torch.full((ROWS,), 500.0)
    per_row = [(adapters[i % len(adapters)].name, 1.0) for i in range(ROWS)]
    kinds = {"base": None, "in_place": add_terms, "per_group": per_group}

    def forward(kind: str) -> float:
        lora_apply.add_terms = kinds[kind] or add_terms
        start = time.perf_counter()
        with torch.no_grad():
            if kinds[kind] is None:
                transformer(latents, timestep, text)
            else:
                with loras.rows(per_row):
                    transformer(latents, timestep, text)
        return time.perf_counter() - start

    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        for kind in kinds:
            forward(kind)  # warm
        for _ in range(forwards):
            for kind in kinds:
                seconds[kind].append(forward(kind))
    finally:
        lora_apply.add_terms = add_terms
    median = {kind: statistics.median(v) for kind, v in seconds.items()}
    return {"bench": "lora_terms", "model": "medium-wan", "rows": ROWS, "adapters": len(adapters), "rank": 16,
            "forwards": forwards, "forward_s_base": round(median["base"], 4),
            "in_place_over_base": round(median["in_place"] / median["base"], 4),
            "per_group_over_base": round(median["per_group"] / median["base"], 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forwards", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.forwards)
    print(f"medium Wan forward, {ROWS} rows with 4 rank-16 adapters, {args.forwards} interleaved forwards each: "
          f"{result['forward_s_base'] * 1e3:.0f} ms without adapters; in place {result['in_place_over_base']:.3f}x, "
          f"per group {result['per_group_over_base']:.3f}x")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
