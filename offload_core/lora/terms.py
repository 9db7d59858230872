"""The low-rank terms of one adapted Linear's forward, added to its output row by row.

:class:`LoraSet` (``apply.py``) decides which rows of a forward use which adapter; this module
does the arithmetic for one Linear: for each group of rows (one adapter at one scale), adds
``scaling * (x A^T) B^T`` into those rows of the output; rows of no group keep the base output
bit for bit.

Two ways, the same terms within float rounding:

* **one group** (one adapter in the forward, the common case): PEFT's own order,
  ``lora_B(lora_A(x)) * scaling``, over all rows at once or gathered rows.
* **several groups of one rank** (a step batch of requests with different adapters): ONE pair of
  batched matmuls for all of them. Each row gets its adapter's A and B (a gather of the small
  matrices, ``rows x rank x (in + out)``, never of the activations), its scaling goes on the
  rank-wide intermediate, and when every row has an adapter the term lands with one ``add_`` and
  no gather or scatter of the Linear's input or output. Per group, the same forward made five
  passes over each group's rows (index_select, two matmuls, the scaling's multiply over the
  output width, index_add_): the medium Wan's 4-adapter forward spent ~217 of its ~335 ms of
  low-rank time in the three that are not matmuls (bench/results/lora-cpu-2026-12-04.json).

Runs on the forward's thread, in the process that runs the model (a Denoiser replica).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn import functional as F


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
    if len(groups) > 1 and len({(g.a.shape, g.b.shape, g.a.dtype) for g in groups}) == 1:
        return _batched(x, out, groups)
    for group in groups:
        if group.all_rows:
            out.add_(_term(x, group, out.dtype))
        else:
            out.index_add_(0, group.rows, _term(x.index_select(0, group.rows), group, out.dtype))
    return out


def _term(x: torch.Tensor, group: GroupTerm, dtype: torch.dtype) -> torch.Tensor:
    """``scaling * (x A^T) B^T`` in the order PEFT computes it (``lora_B(lora_A(x)) * scaling``), in ``dtype``."""
    x = x if x.dtype == group.a.dtype else x.to(group.a.dtype)
    term = F.linear(F.linear(x, group.a), group.b) * group.scaling
    return term if term.dtype == dtype else term.to(dtype)


def _batched(x: torch.Tensor, out: torch.Tensor, groups: Sequence[GroupTerm]) -> torch.Tensor:
    """Every group's term from one pair of batched matmuls (the groups share rank, shapes and dtype)."""
    n = x.shape[0]
    device = groups[0].a.device
    rows = torch.cat([g.rows for g in groups])
    which = torch.cat([torch.full((g.rows.numel(),), i, dtype=torch.long, device=device)
                       for i, g in enumerate(groups)])
    covered = rows.numel() == n  # groups never share a row: every row is in one
    if covered:  # in the input's own order: no gather of x, no scatter into out
        which = torch.empty_like(which).index_copy_(0, rows, which)
        used = x
    else:
        used = x.index_select(0, rows)
    dtype = groups[0].a.dtype
    a = torch.stack([g.a for g in groups]).index_select(0, which)  # [m, rank, in]
    b = torch.stack([g.b for g in groups]).index_select(0, which)  # [m, out, rank]
    scaling = torch.tensor([g.scaling for g in groups], dtype=dtype, device=device).index_select(0, which)
    flat = used.reshape(used.shape[0], -1, used.shape[-1])  # [m, tokens, in] (tokens 1 for a [m, in] input)
    flat = flat if flat.dtype == dtype else flat.to(dtype)
    low = torch.bmm(flat, a.transpose(1, 2)).mul_(scaling.view(-1, 1, 1))
    term = torch.bmm(low, b.transpose(1, 2)).reshape(*used.shape[:-1], b.shape[1])
    term = term if term.dtype == out.dtype else term.to(out.dtype)
    return out.add_(term) if covered else out.index_add_(0, rows, term)
