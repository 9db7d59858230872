"""Inductor's on-disk cache under the configured directory: what a restarted process loads instead of compiling.

Whether a second process compiles faster is measured by bench/compile.py (a timed test would flake);
this pins that the configured directory is where the compiled graphs go.
"""
from __future__ import annotations

import torch
from torch import nn

from offload_core.compile import CompileConfig, apply_block_compile


class CachedBlock(nn.Module):
    """A block no other test compiles, so its graph is compiled here (not found in dynamo's memory)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    offload_layer_groups = ("blocks",)

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(CachedBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_compiled_graphs_are_written_under_the_configured_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))  # restored after the test
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        eager = model(x)
    blocks = apply_block_compile(model, CompileConfig(cache_dir=str(tmp_path / "inductor")))
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        blocks.remove()
    torch.testing.assert_close(out, eager)
    assert [c.__name__ for c in blocks.kernels] == ["CachedBlock"]
    written = [p for p in (tmp_path / "inductor").rglob("*") if p.is_file()]
    assert any("fxgraph" in p.parts for p in written), sorted(str(p.relative_to(tmp_path)) for p in written)[:10]
