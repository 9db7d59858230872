"""The Denoiser's step cache: first-block caching per request, under step batching. Runs in the Denoiser replica.

Per request, the first transformer block's residual (its output minus its input, over the
request's rows) is compared with that request's residual at its last step that ran every block:
``mean|r - r_prev| / mean|r_prev|``. Below the request's ``cache_threshold`` the request skips the
remaining blocks this step and reuses the residual they added at that step (ParaAttention's and
diffusers' ``FirstBlockCacheConfig`` rule; comparing with the last *computed* step bounds the drift
a run of skips can accumulate).

In a batch, requests decide alone: the remaining blocks run on the sub-batch of rows that compute,
the others pass through and get their cached residual after the last block. When every request
skips, the streamer is told right after the first block (``LayerStreamer.skip_rest_of_use``): the
skipped blocks are not copied, and the prefetch window moves to the next step's first layers
before it fills. The copies already issued for the window ahead of the first block are wasted: at
most ``prefetch_depth`` layers per such decision.

Families: a block's output form and its per-row inputs are the family's :class:`BlockForm`,
declared in its adapter module (Wan: hidden alone; Flux, SD3, Qwen-Image: (encoder, hidden);
HunyuanVideo 1.5: (hidden, encoder), with its joint text mask per row; Qwen-Image's text mask per
row). Z-Image runs no step cache: its first block refines the image tokens alone and its last runs
on image + caption tokens, so the first block's residual has no place in the last one's output.

Threshold 0 is off: a forward whose requests all have threshold 0 is the plain forward, untouched.
The blocks' forwards are wrapped once (an instance attribute over the class's ``forward``); with no
cached forward active the wrapper calls the original at once.
"""
from __future__ import annotations

import contextlib
import enum
import inspect
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from offload_core.layout import STREAMER_ATTRIBUTE, declared_layer_groups, resolve_layer_group

logger = logging.getLogger(__name__)

# Block inputs that carry one row per batch row (sliced for a sub-batch); the rest (rotary
# embeddings, attention kwargs) are shared by every row. Wan's and Flux's blocks name them so.
ROW_INPUTS = ("hidden_states", "encoder_hidden_states", "temb")
CACHE_ATTRIBUTE = "_offload_step_cache"


class BlockOutput(enum.Enum):
    """What a transformer block returns, in order (what a skipped block must return in its place)."""

    HIDDEN = "hidden"  # hidden_states alone (Wan)
    ENCODER_HIDDEN = "encoder, hidden"  # (encoder_hidden_states, hidden_states): Flux, SD3, Qwen-Image
    HIDDEN_ENCODER = "hidden, encoder"  # (hidden_states, encoder_hidden_states): HunyuanVideo 1.5


@dataclass(frozen=True)
class BlockForm:
    """A family's transformer block, as the step cache calls it: its output form and its per-row inputs
    (sliced to the computing rows of a batch in which some requests skip). Declared by the family's
    adapter module (``deployments/models/<family>.py``)."""

    output: BlockOutput
    row_inputs: tuple[str, ...] = ROW_INPUTS


def detected_form(transformer: nn.Module) -> BlockForm:
    """Wan's or Flux's form, told apart by the block signature: Flux's blocks take image_rotary_emb and
    return (encoder, hidden); Wan's take rotary_emb and return hidden alone."""
    blocks = [layer for group in declared_layer_groups(transformer)
              for layer in resolve_layer_group(transformer, group).layers]
    pair = bool(blocks) and "image_rotary_emb" in inspect.signature(blocks[0].forward).parameters
    return BlockForm(BlockOutput.ENCODER_HIDDEN if pair else BlockOutput.HIDDEN)


@dataclass
class RequestCache:
    """One request's cache state for one transformer (a two-expert Wan keeps one per expert)."""

    first_residual: torch.Tensor | None = None  # at its last step that ran every block
    tail_residual: torch.Tensor | None = None  # what the remaining blocks added at that step


@dataclass
class CachedRequest:
    """What the cache needs of a request: its threshold, its state per transformer, its skip count."""

    threshold: float = 0.0
    states: dict[int, RequestCache] = field(default_factory=dict)
    skipped: int = 0  # steps whose remaining blocks it skipped
    decided: int = 0  # steps it decided on (threshold > 0)


@dataclass
class _Forward:
    """One cached forward: the requests, their rows, and what the first block decided."""

    transformer: int
    requests: Sequence[CachedRequest]
    rows: Sequence[torch.Tensor]  # per request, its row indices in the batch
    skip: list[bool] = field(default_factory=list)
    first: torch.Tensor | None = None  # the first block's hidden output

    @property
    def computing(self) -> torch.Tensor:
        return torch.cat([rows for rows, skip in zip(self.rows, self.skip) if not skip])


class StepCache:
    """Wraps one transformer's blocks; ``active(...)`` makes one forward a cached one."""

    def __init__(self, transformer: nn.Module, form: BlockForm | None = None):
        self.transformer = transformer
        self.form = form or detected_form(transformer)
        self.blocks = tuple(layer for group in declared_layer_groups(transformer)
                            for layer in resolve_layer_group(transformer, group).layers)
        self._active: _Forward | None = None
        self.all_skipped = 0  # forwards in which every request skipped: no copies of the rest
        for index, block in enumerate(self.blocks):
            original = block.forward
            signature = inspect.signature(original)
            block.forward = lambda *a, _i=index, _f=original, _s=signature, **k: self._call(_i, _f, _s, a, k)

    @contextlib.contextmanager
    def active(self, requests: Sequence[CachedRequest], rows: Sequence[Sequence[int]]) -> Iterator[None]:
        """Run the enclosed transformer call cached, for ``requests`` at ``rows`` of its batch."""
        if not any(r.threshold > 0 for r in requests) or not self.blocks:
            yield  # off: the plain forward
            return
        device = next(iter(self.transformer.buffers()), torch.empty(0)).device
        self._active = _Forward(id(self.transformer), requests,
                                [torch.as_tensor(list(r), dtype=torch.long, device=device) for r in rows])
        try:
            yield
        finally:
            self._active = None

    # -- the wrapped block forward ------------------------------------------------------------------
    def _call(self, index: int, original: Callable, signature: inspect.Signature, args: tuple, kwargs: dict):
        forward = self._active
        if forward is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        if index == 0:
            out = original(*args, **kwargs)
            forward.first = self._hidden(out)
            self._decide(forward, forward.first - bound.arguments["hidden_states"])
        elif not any(forward.skip):
            out = original(*args, **kwargs)
        elif all(forward.skip):
            out = self._passthrough(bound)
        else:
            out = self._on_rows(original, bound, forward.computing)
        if index == len(self.blocks) - 1:
            out = self._finish(forward, out)
        return out

    def _decide(self, forward: _Forward, residual: torch.Tensor) -> None:
        for request, rows in zip(forward.requests, forward.rows):
            state = request.states.setdefault(forward.transformer, RequestCache())
            mine = residual.index_select(0, rows)
            skip = False
            if request.threshold > 0:
                request.decided += 1
                if state.first_residual is not None and state.tail_residual is not None:
                    change = (mine - state.first_residual).abs().mean() / state.first_residual.abs().mean()
                    skip = bool(change < request.threshold)
            if not skip:
                state.first_residual = mine
            forward.skip.append(skip)
        if all(forward.skip):
            self.all_skipped += 1
            streamer = getattr(self.transformer, STREAMER_ATTRIBUTE, None)
            if streamer is not None:  # before the window fills with blocks that will not run
                streamer.skip_rest_of_use()
            logger.debug("step cache: all %d requests skip the remaining %d blocks", len(forward.skip),
                         len(self.blocks) - 1)

    def _finish(self, forward: _Forward, out):
        hidden = self._hidden(out)
        result = hidden.clone() if any(forward.skip) else hidden
        for request, rows, skip in zip(forward.requests, forward.rows, forward.skip):
            state = request.states[forward.transformer]
            first = forward.first.index_select(0, rows)
            if skip:
                result.index_copy_(0, rows, first + state.tail_residual)
                request.skipped += 1
            else:
                state.tail_residual = hidden.index_select(0, rows) - first
        return self._with_hidden(out, result)

    # -- the block's form ---------------------------------------------------------------------------
    def _hidden(self, out) -> torch.Tensor:
        """A block's hidden-states output."""
        output = self.form.output
        return out if output is BlockOutput.HIDDEN else out[1 if output is BlockOutput.ENCODER_HIDDEN else 0]

    def _with_hidden(self, out, hidden: torch.Tensor):
        output = self.form.output
        if output is BlockOutput.HIDDEN:
            return hidden
        return (out[0], hidden) if output is BlockOutput.ENCODER_HIDDEN else (hidden, out[1])

    def _passthrough(self, bound: inspect.BoundArguments):
        """What a skipped block returns: its inputs, in its output's form."""
        hidden, encoder = bound.arguments["hidden_states"], bound.arguments.get("encoder_hidden_states")
        return {BlockOutput.HIDDEN: hidden, BlockOutput.ENCODER_HIDDEN: (encoder, hidden),
                BlockOutput.HIDDEN_ENCODER: (hidden, encoder)}[self.form.output]

    def _on_rows(self, original: Callable, bound: inspect.BoundArguments, rows: torch.Tensor):
        """Run the block on ``rows`` of the batch; the other rows pass through unchanged."""
        sliced = dict(bound.arguments)
        for name in self.form.row_inputs:
            if isinstance(sliced.get(name), torch.Tensor):
                sliced[name] = sliced[name].index_select(0, rows)
        out = original(**sliced)
        whole = self._passthrough(bound)
        if not isinstance(out, tuple):
            hidden = whole.clone()
            hidden.index_copy_(0, rows, out)
            return hidden
        merged = []
        for mine, computed in zip(whole, out):
            if computed is None:  # SD3's last block returns no encoder stream (context_pre_only)
                merged.append(None)
                continue
            value = mine.clone()
            value.index_copy_(0, rows, computed)
            merged.append(value)
        return tuple(merged)


def step_cache_for(transformer: nn.Module, form: BlockForm | None = None) -> StepCache:
    """The transformer's one step cache, made (its blocks wrapped) at the first cached forward;
    ``form``: the family's block form (None: Wan's or Flux's, told by the signature)."""
    cache = getattr(transformer, CACHE_ATTRIBUTE, None)
    if cache is None:
        cache = StepCache(transformer, form)
        setattr(transformer, CACHE_ATTRIBUTE, cache)
    return cache
