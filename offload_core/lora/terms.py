"""The low-rank terms of one adapted Linear's forward, added to its output row by row.

:class:`LoraSet` (``apply.py``) decides which rows of a forward use which adapter; this module
does the arithmetic for one Linear: for each group of rows (one adapter at one scale), adds
``scaling * (x A^T) B^T`` into those rows of the output; rows of no group keep the base output
bit for bit. The terms equal PEFT's ``lora_B(lora_A(x)) * scaling`` within float rounding (the
scaling goes on the rank-wide intermediate, and the second matmul accumulates into the output).

* **Every row adapted, one rank** (a step batch whose requests all name adapters, or one adapter
  for the whole batch): each row gets its adapter's A and B (a gather of the small matrices,
  ``rows x rank x (in + out)``, never of the activations), then ``bmm`` for ``x A^T`` and
  ``baddbmm_`` accumulating ``(.) B^T`` straight into the output: no gather of the input, no
  output-wide temporary, multiply or scatter (one group: the same with ``mm`` / ``addmm_``).
  The output-wide passes were the cost: on the medium Wan at 4 adapters (8 rows, its cross-attention
  K/V over 512 text tokens), a forward took 1.186x the one without adapters per group (index_select,
  two matmuls, the output-wide multiply, index_add_), 1.147x with bmm and a separate term, 1.074-1.092x
  accumulating in place (20 interleaved forwards each, 1 thread; bench/results/lora-cpu-2026-12-05.json).
* **Otherwise** (rows without an adapter, ranks that differ): per group, its rows gathered, the
  term scattered back with ``index_add_``.

Runs on the forward's thread, in the process that runs the model (a Denoiser replica).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class GroupTerm:
    """One adapter at one scale on some rows of a Linear's input."""

    a: torch.Tensor  # [rank, in], on the device
    b: torch.Tensor  # [out, rank]
    rows: torch.Tensor  # long, on the device: the input rows (batch rows times the row multiple)
    scaling: float  # the request's scale x alpha / rank
    all_rows: bool  # every row of the input: added without indexing


def add_terms(x: torch.Tensor, out: torch.Tensor, groups: Sequence[GroupTerm]) -> torch.Tensor:
    """``out`` (the Linear's output for input ``x``) plus each group's term in its rows, in place."""
    if _in_place(x, out, groups):
        return _every_row(x, out, groups)
    for group in groups:
        rows = x if group.all_rows else x.index_select(0, group.rows)
        term = _low(rows, group) @ group.b.t()
        term = term if term.dtype == out.dtype else term.to(out.dtype)
        if group.all_rows:
            out.add_(term)
        else:
            out.index_add_(0, group.rows, term)
    return out


def _in_place(x: torch.Tensor, out: torch.Tensor, groups: Sequence[GroupTerm]) -> bool:
    """Whether the groups cover every row with one rank and the output's dtype, on a contiguous output."""
    same = len({(g.a.shape, g.b.shape, g.a.dtype) for g in groups}) == 1 and groups[0].a.dtype == out.dtype
    return same and out.is_contiguous() and sum(g.rows.numel() for g in groups) == x.shape[0]


def _low(x: torch.Tensor, group: GroupTerm) -> torch.Tensor:
    """``scaling * x A^T``: the rank-wide intermediate, scaled (cheaper than scaling the output)."""
    x = x if x.dtype == group.a.dtype else x.to(group.a.dtype)
    return (x @ group.a.t()).mul_(group.scaling)


def _every_row(x: torch.Tensor, out: torch.Tensor, groups: Sequence[GroupTerm]) -> torch.Tensor:
    """Every row's term accumulated into ``out`` in place (groups cover all rows, one rank and dtype)."""
    n, width = x.shape[0], out.shape[-1]
    if len(groups) == 1:
        low = _low(x.reshape(-1, x.shape[-1]), groups[0])
        out.view(-1, width).addmm_(low, groups[0].b.t())
        return out
    device, dtype = groups[0].a.device, groups[0].a.dtype
    which = torch.empty(n, dtype=torch.long, device=device)  # each row's group
    for i, group in enumerate(groups):
        which.index_fill_(0, group.rows, i)
    a = torch.stack([g.a for g in groups]).index_select(0, which)  # [n, rank, in]
    b = torch.stack([g.b for g in groups]).index_select(0, which)  # [n, out, rank]
    scaling = torch.tensor([g.scaling for g in groups], dtype=dtype, device=device).index_select(0, which)
    flat = x.reshape(n, -1, x.shape[-1])  # [n, tokens, in] (tokens 1 for an [n, in] input)
    flat = flat if flat.dtype == dtype else flat.to(dtype)
    low = torch.bmm(flat, a.transpose(1, 2)).mul_(scaling.view(-1, 1, 1))
    out.view(n, -1, width).baddbmm_(low, b.transpose(1, 2))
    return out
