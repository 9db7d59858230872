"""What a stage asks of torch.compile: the mode, the backend and the request-shape buckets.

Pure data, read by ``offload_core.compile.blocks`` in the process that runs the model.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from offload_core.compile.buckets import ShapeBucket


class CompileMode(str, enum.Enum):
    """``none``: eager. ``blocks``: each repeated block class compiled once (regional compile)."""

    NONE = "none"
    BLOCKS = "blocks"


# 64 compiled entries per block class: one per (bucket x grad mode x dtype) a replica serves is a
# handful; dynamo's default of 8 would silently fall back to eager after the 8th, the slowest
# failure there is (diffusers' compile docs raise it for the same reason).
DEFAULT_RECOMPILE_LIMIT = 64


@dataclass(frozen=True)
class CompileConfig:
    """How ``apply_block_compile`` compiles.

    ``fullgraph``: one graph per block, no break (refused blocks fall back to breaks, logged);
    ``backend``/``mode``: torch.compile's (inductor, default mode: no CUDA graphs, whose static input
    addresses a streamed layer, bound to a different ring slot at each use, cannot give);
    ``buckets``: the request shapes served, grouped so each bucket compiles once (see ``buckets``);
    ``cache_dir``: inductor's on-disk cache, so a restarted process loads instead of compiling.
    """

    mode: CompileMode = CompileMode.BLOCKS
    fullgraph: bool = True
    backend: str = "inductor"
    mode_name: str | None = None
    buckets: tuple[ShapeBucket, ...] = ()
    cache_dir: str | None = None
    recompile_limit: int = DEFAULT_RECOMPILE_LIMIT

    def __post_init__(self):
        if not isinstance(self.mode, CompileMode):
            object.__setattr__(self, "mode", CompileMode(self.mode))
        if self.mode_name in ("reduce-overhead", "max-autotune"):
            raise ValueError(f"compile mode {self.mode_name!r} records CUDA graphs, which pin every input's "
                             "address; streamed weights move between ring slots: use mode None or "
                             "'max-autotune-no-cudagraphs'")
        names = [bucket.name for bucket in self.buckets]
        if len(set(names)) != len(names):
            raise ValueError(f"compile buckets must have distinct names, got {names}")
