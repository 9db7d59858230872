"""add_terms: several adapters of one rank in one pair of batched matmuls give each row what its
adapter gives it alone (PEFT's order), and rows of no adapter keep the base output bit for bit."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from offload_core.lora.terms import GroupTerm, add_terms

TOLERANCE = 1e-5


def _group(rows: list[int], n: int, rank: int, seed: int, scaling: float, dim_in=24, dim_out=40) -> GroupTerm:
    generator = torch.Generator().manual_seed(seed)
    return GroupTerm(torch.randn(rank, dim_in, generator=generator), torch.randn(dim_out, rank, generator=generator),
                     torch.tensor(rows, dtype=torch.long), scaling, len(rows) == n)


def _peft(x: torch.Tensor, group: GroupTerm) -> torch.Tensor:
    return F.linear(F.linear(x, group.a), group.b) * group.scaling


@pytest.mark.parametrize("shape", [(6, 24), (6, 5, 24), (6, 3, 5, 24)], ids=["rows", "tokens", "frames"])
@pytest.mark.parametrize("layout", [[[0, 3], [1, 4], [2, 5]], [[5, 0], [2], [3, 1, 4]], [[0, 3], [5]]],
                         ids=["strided", "uneven", "some-rows-without"])
def test_batched_groups_give_each_row_its_adapters_term_and_other_rows_stay_bitwise(shape, layout):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator)
    base = torch.randn(*shape[:-1], 40, generator=generator)
    groups = [_group(rows, shape[0], 4, seed, 0.5 + seed) for seed, rows in enumerate(layout)]
    got = add_terms(x, base.clone(), groups)
    adapted = set()
    for group in groups:
        for row in group.rows.tolist():
            want = base[row] + _peft(x[row:row + 1], group)[0]
            assert (got[row] - want).abs().max() <= TOLERANCE * want.abs().max(), row
            adapted.add(row)
    for row in set(range(shape[0])) - adapted:
        assert torch.equal(got[row], base[row]), f"row {row} has no adapter: the base output bit for bit"


def test_groups_of_different_ranks_each_add_their_own_term():
    x, base = torch.randn(4, 5, 24), torch.randn(4, 5, 40)
    groups = [_group([0, 2], 4, 4, 1, 1.0), _group([1], 4, 8, 2, 0.3)]
    got = add_terms(x, base.clone(), groups)
    for group in groups:
        for row in group.rows.tolist():
            assert (got[row] - base[row] - _peft(x[row:row + 1], group)[0]).abs().max() <= TOLERANCE * 10
    assert torch.equal(got[3], base[3])


def test_one_adapter_on_every_row_accumulates_peft_s_term_into_the_output():
    x, base = torch.randn(3, 5, 24), torch.randn(3, 5, 40)
    group = _group([0, 1, 2], 3, 4, 1, 0.8)
    out = base.clone()
    got = add_terms(x, out, [group])
    want = base + _peft(x, group)
    assert got is out and (got - want).abs().max() <= TOLERANCE * want.abs().max()


def test_a_non_contiguous_output_still_gets_every_rows_term():
    x = torch.randn(4, 5, 24)
    base = torch.randn(4, 40, 5).transpose(1, 2)  # [4, 5, 40], not contiguous
    groups = [_group([0, 2], 4, 4, 1, 1.0), _group([1, 3], 4, 4, 2, 0.5)]
    got = add_terms(x, base.clone(), groups)
    for group in groups:
        for row in group.rows.tolist():
            want = base[row] + _peft(x[row:row + 1], group)[0]
            assert (got[row] - want).abs().max() <= TOLERANCE * want.abs().max()


def test_a_half_precision_output_gets_the_term_in_its_dtype():
    x, base = torch.randn(4, 5, 24), torch.randn(4, 5, 40).to(torch.bfloat16)
    groups = [_group([0, 1], 4, 4, 1, 1.0), _group([2, 3], 4, 4, 2, 1.0)]
    got = add_terms(x, base.clone(), groups)
    assert got.dtype == torch.bfloat16
    want = base.float() + torch.cat([_peft(x[:2], groups[0]), _peft(x[2:], groups[1])])
    assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()
