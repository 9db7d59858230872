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

Threshold 0 is off: a forward whose requests all have threshold 0 is the plain forward, untouched.
The blocks' forwards are wrapped once (an instance attribute over the class's ``forward``); with no
cached forward active the wrapper calls the original at once.
"""
from __future__ import annotations

import contextlib
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

    def __init__(self, transformer: nn.Module):
        self.transformer = transformer
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
            forward.first = _hidden(out)
            self._decide(forward, forward.first - bound.arguments["hidden_states"])
        elif not any(forward.skip):
            out = original(*args, **kwargs)
        elif all(forward.skip):
            out = _passthrough(bound)
        else:
            out = _on_rows(original, bound, forward.computing)
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
        hidden = _hidden(out)
        result = hidden.clone() if any(forward.skip) else hidden
        for request, rows, skip in zip(forward.requests, forward.rows, forward.skip):
            state = request.states[forward.transformer]
            first = forward.first.index_select(0, rows)
            if skip:
                result.index_copy_(0, rows, first + state.tail_residual)
                request.skipped += 1
            else:
                state.tail_residual = hidden.index_select(0, rows) - first
        return (out[0], result) if isinstance(out, tuple) else result


def step_cache_for(transformer: nn.Module) -> StepCache:
    """The transformer's one step cache, made (its blocks wrapped) at the first cached forward."""
    cache = getattr(transformer, CACHE_ATTRIBUTE, None)
    if cache is None:
        cache = StepCache(transformer)
        setattr(transformer, CACHE_ATTRIBUTE, cache)
    return cache


def _hidden(out) -> torch.Tensor:
    """A block's hidden-states output: the tensor (Wan), or the second of (encoder, hidden) (Flux)."""
    return out[1] if isinstance(out, tuple) else out


def _passthrough(bound: inspect.BoundArguments):
    """What a skipped block returns: its inputs, in its output's form."""
    hidden = bound.arguments["hidden_states"]
    encoder = bound.arguments.get("encoder_hidden_states")
    return (encoder, hidden) if _returns_pair(bound) else hidden


def _returns_pair(bound: inspect.BoundArguments) -> bool:
    # Flux's blocks take image_rotary_emb and return (encoder_hidden_states, hidden_states); Wan's
    # take rotary_emb and return hidden_states alone.
    return "image_rotary_emb" in bound.signature.parameters


def _on_rows(original: Callable, bound: inspect.BoundArguments, rows: torch.Tensor):
    """Run the block on ``rows`` of the batch; the other rows pass through unchanged."""
    sliced = dict(bound.arguments)
    for name in ROW_INPUTS:
        if isinstance(sliced.get(name), torch.Tensor):
            sliced[name] = sliced[name].index_select(0, rows)
    out = original(**sliced)
    whole = _passthrough(bound)
    if isinstance(out, tuple):
        encoder, hidden = (t.clone() for t in whole)
        encoder.index_copy_(0, rows, out[0])
        hidden.index_copy_(0, rows, out[1])
        return encoder, hidden
    hidden = whole.clone()
    hidden.index_copy_(0, rows, out)
    return hidden
