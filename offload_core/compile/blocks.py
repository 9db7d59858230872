"""Compiling a model's repeated blocks once per class, with the streaming engine's hooks left outside.

Why not ``module.compile()`` (diffusers' ``compile_repeated_blocks``): it compiles ``_call_impl``,
the hooks included, and the engine's hooks are not traceable. With ``fullgraph=True`` dynamo stops
at the pre-hook's ``torch.is_inference_mode_enabled()`` (and the claim's ``threading.get_ident``);
without it, dynamo breaks the graph inside the hooks and traces their parameter swaps
(``param.data = view``), so the graph's weight inputs are the released zero-element placeholders and
the compiled code's ``assert_size_stride`` fails ("wrong number of dimensions"). Here only the
class's ``forward`` is compiled: every instance's ``forward`` becomes the class's one compiled
callable, so ``nn.Module.__call__`` runs the engine's pre-hook eagerly (weights bound to their ring
slot or resident buffer), then the compiled forward, then the post-hook (weights released).

No recompilation per ring slot: dynamo inlines nn.Module calls (torch 2.13: always) and lifts
parameters to graph inputs guarded by dtype, shape and stride, never by address, so a layer bound
to another slot, or another instance of the class, resident or streamed, hits the same graph.
Runs in the process that runs the model's forwards.
"""
from __future__ import annotations

import functools
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from compat.diffusers import repeated_block_names
from compat.torch import compiled_graph_count, is_unsupported_trace, mark_dynamic, raise_recompile_limit, tree_leaves
from offload_core.compile.buckets import BucketRule, Signature, learn_rules, signature
from offload_core.compile.config import CompileConfig, CompileMode
from offload_core.fp8_widen import WidenMode
from offload_core.layout import (
    COMPILED_ATTRIBUTE,
    STREAMER_ATTRIBUTE,
    LayoutError,
    declared_layer_groups,
    resolve_layer_group,
)

logger = logging.getLogger(__name__)


class BlockCompileError(RuntimeError):
    """The model's blocks cannot be compiled as asked (no repeated blocks, or already compiled)."""


class BlockKernel:
    """One block class's compiled forward, called by every instance (resident or streamed)."""

    def __init__(self, cls: type, config: CompileConfig):
        self.cls = cls
        self.config = config
        self.fullgraph = config.fullgraph
        self.rules: list[BucketRule] = []
        self._recording: list[list[Signature]] | None = None  # per run, the distinct signatures seen
        self._unmatched: set[Signature] = set()
        self._compiled = self._compile(self.fullgraph)

    def _compile(self, fullgraph: bool):
        return torch.compile(self.cls.forward, fullgraph=fullgraph, backend=self.config.backend,
                             mode=self.config.mode_name)

    def bind(self, module: nn.Module) -> Callable:
        """``module``'s forward through this kernel, with the original's signature (a step cache reads it)."""
        original = self.cls.forward.__get__(module)

        def forward(*args, **kwargs):
            return self(module, *args, **kwargs)

        return functools.update_wrapper(forward, original)

    def __call__(self, module: nn.Module, *args, **kwargs):
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in leaves):
            # The engine's order trace runs a forward on meta tensors (offload_core.order): eager,
            # never a graph compiled for meta.
            return self.cls.forward(module, *args, **kwargs)
        seen = signature(leaves)
        if self._recording is not None:  # a warm-up's eager pass: learn the shapes, compile nothing
            run = self._recording[-1]
            if seen not in run:
                run.append(seen)
            return self.cls.forward(module, *args, **kwargs)
        rule = next((rule for rule in self.rules if rule.matches(seen)), None)
        if rule is not None:
            for dim in rule.dynamic:
                mark_dynamic(leaves[dim.leaf], dim.dim, dim.low, dim.high)
        elif seen not in self._unmatched:
            self._unmatched.add(seen)
            logger.info("compiled %s: a call outside every bucket (inputs %s): compiled for it on demand",
                        self.cls.__name__, seen)
        try:
            return self._compiled(module, *args, **kwargs)
        except Exception as error:
            if not (self.fullgraph and is_unsupported_trace(error)):
                raise
            # Refused while tracing, before any of the block's kernels ran: retrying with breaks is safe.
            logger.info("compiled %s: no full graph (%s); compiled with graph breaks",
                        self.cls.__name__, str(error).splitlines()[0])
            self.fullgraph = False
            self._compiled = self._compile(False)
            return self._compiled(module, *args, **kwargs)

    def start_run(self) -> None:
        if self._recording is None:
            self._recording = []
        self._recording.append([])

    def stop_recording(self) -> list[list[Signature]]:
        runs, self._recording = self._recording or [], None
        return runs


_KERNELS: dict[tuple, BlockKernel] = {}  # one per (class, how compiled), shared by every model in the process
_KERNELS_LOCK = threading.Lock()


def kernel_for(cls: type, config: CompileConfig) -> BlockKernel:
    key = (cls, config.fullgraph, config.backend, config.mode_name)
    with _KERNELS_LOCK:
        if key not in _KERNELS:
            _KERNELS[key] = BlockKernel(cls, config)
        return _KERNELS[key]


@dataclass(frozen=True)
class CompileSummary:
    """What the plan and ``/v1/residency`` show: compiled or not, which classes, which buckets."""

    mode: CompileMode
    classes: tuple[str, ...] = ()
    blocks: int = 0
    buckets: tuple[str, ...] = ()


class CompiledBlocks:
    """A model whose repeated blocks run compiled; ``remove()`` gives back the eager forwards."""

    def __init__(self, model: nn.Module, config: CompileConfig, kernels: dict[type, BlockKernel],
                 instances: tuple[nn.Module, ...]):
        self.model = model
        self.config = config
        self.kernels = kernels
        self.instances = instances
        self.warmed: tuple[str, ...] = ()  # buckets compiled by warm_buckets

    def summary(self) -> CompileSummary:
        return CompileSummary(CompileMode.BLOCKS, tuple(sorted(cls.__name__ for cls in self.kernels)),
                              len(self.instances), tuple(bucket.name for bucket in self.config.buckets))

    @staticmethod
    def graphs_compiled() -> int:
        """Graphs compiled in this process so far (a warm-up's delta is its compiles; a request's, recompiles)."""
        return compiled_graph_count()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Blocks run eager inside, recording their inputs' shapes (``next_run`` between shapes)."""
        try:
            yield
        finally:
            for kernel in self.kernels.values():
                kernel.stop_recording()

    def next_run(self) -> None:
        for kernel in self.kernels.values():
            kernel.start_run()

    def learn(self, bucket: str) -> None:
        """Turn the recorded runs (one per shape of ``bucket``) into each class's rules."""
        for kernel in self.kernels.values():
            runs = kernel.stop_recording()
            learned = learn_rules(bucket, runs)
            kernel.rules = [rule for rule in kernel.rules if rule.bucket != bucket] + list(learned)
            logger.info("compiled %s: bucket %s, %d shapes -> %d call rules, dynamic dims %s", kernel.cls.__name__,
                        bucket, len(runs), len(learned),
                        [[(d.leaf, d.dim, d.low, d.high) for d in rule.dynamic] for rule in learned])

    def remove(self) -> None:
        for module in self.instances:
            if "forward" in vars(module):
                delattr(module, "forward")
        streamer = getattr(self.model, STREAMER_ATTRIBUTE, None)
        if streamer is not None:
            streamer.set_widen(streamer.config.widen)
        if getattr(self.model, COMPILED_ATTRIBUTE, None) is self:
            delattr(self.model, COMPILED_ATTRIBUTE)


def block_classes(model: nn.Module) -> tuple[type, ...]:
    """diffusers' declared repeated blocks, else the engine's streamed units (the layer groups' classes).

    A declared block holding a streamed unit inside it would put that unit's hooks inside the
    compiled region: the units' classes are compiled instead."""
    streamer = getattr(model, STREAMER_ATTRIBUTE, None)
    if streamer is not None:
        units = tuple(layer.module for layer in streamer.layers)
    else:
        try:
            units = tuple(m for g in declared_layer_groups(model) for m in resolve_layer_group(model, g).layers)
        except LayoutError:
            units = ()
    unit_classes = tuple(dict.fromkeys(type(unit) for unit in units))
    names = set(repeated_block_names(type(model)))
    declared = tuple(dict.fromkeys(type(m) for m in model.modules() if type(m).__name__ in names))
    unit_ids = {id(unit) for unit in units}
    wraps_unit = any(id(inner) in unit_ids for m in model.modules() if type(m) in declared
                     for inner in m.modules() if inner is not m)
    if declared and not (streamer is not None and wraps_unit):
        return declared
    if not unit_classes:
        raise BlockCompileError(f"{type(model).__name__} declares no repeated blocks and no layer groups to compile")
    return unit_classes


def apply_block_compile(model: nn.Module, config: CompileConfig | None = None) -> CompiledBlocks | None:
    """Compile ``model``'s repeated block classes (regional compile); None for ``CompileMode.NONE``.

    Apply after ``apply_layer_streaming`` (the engine's units are known then); resident and streamed
    layers of one class share the compiled code."""
    config = config or CompileConfig()
    if config.mode is CompileMode.NONE:
        return None
    if getattr(model, COMPILED_ATTRIBUTE, None) is not None:
        raise BlockCompileError(f"{type(model).__name__}'s blocks are already compiled; remove() first")
    limit = raise_recompile_limit(config.recompile_limit)
    if config.cache_dir:
        from compat.torch import use_inductor_cache

        use_inductor_cache(config.cache_dir)
    classes = block_classes(model)
    kernels = {cls: kernel_for(cls, config) for cls in classes}
    instances = tuple(m for m in model.modules() if type(m) in kernels)
    wrapped = [type(m).__name__ for m in instances if "forward" in vars(m)]
    if wrapped:
        # A wrapper already there (a step cache's) calls the eager forward it captured: compile first,
        # then wrap (the step cache wraps at the first cached forward, after the replica's warm-up).
        raise BlockCompileError(f"{len(wrapped)} {wrapped[0]} blocks of {type(model).__name__} already have their "
                                "forward wrapped: compile the blocks before wrapping them")
    for module in instances:
        module.forward = kernels[type(module)].bind(module)
    streamer = getattr(model, STREAMER_ATTRIBUTE, None)
    if streamer is not None:  # its FP8 layers widen in one compiled pass per group too (fp8_widen.WidenMode)
        streamer.set_widen(WidenMode.FUSED)
    blocks = CompiledBlocks(model, config, kernels, instances)
    setattr(model, COMPILED_ATTRIBUTE, blocks)
    logger.info("compile %s: %d blocks of %s compiled once per class (fullgraph %s, backend %s, mode %s); "
                "recompile limit %d; buckets %s; inductor cache %s", type(model).__name__, len(instances),
                [cls.__name__ for cls in classes], config.fullgraph, config.backend, config.mode_name, limit,
                [bucket.name for bucket in config.buckets], config.cache_dir or "torch's default")
    return blocks
