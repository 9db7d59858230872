"""One layer under streaming (the streamed unit): its host copy, its parameters, its device views.

The unit knows how to bind its parameters to device views and release them to placeholders; the
:class:`offload_core.streaming.engine.LayerStreamer` (the driver) decides when, from the hooks that
call :meth:`StreamedLayer.pre_forward` / :meth:`StreamedLayer.post_forward`.

Within a use the ring releases a layer with its views kept (``release(keep_views=True)``): the
parameters go on pointing into the window, which the ring holds for the whole use, and a layer
bound again to the same place (equal layers at depth 1: every forward of a denoise) finds them
there. Pointing a parameter is memory latency, not work: 0.40 us in a loop, 1.6-1.9 us between a
CPU forward's layers, 2.1 us with 16 MB touched between (the parameter's, the view's and the storages'
headers fall out of cache; Wan2.1-14B's block structure, 27 parameters, 2026-12-07), so most of the
hooks' time per layer on a CPU; a GPU's launch thread touches far less between two layers. The ring points
every parameter back at its placeholder when the use ends (``drop_views``), so outside a use a
released weight used without the hooks still fails loudly; inside one it reads the window's bytes.
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import torch
from torch import nn

from offload_core.host.tier import HostingTier
from offload_core.layout import LayerLayout, placeholder, tensor_view
from offload_core.streaming.host_layer import HostLayer
from offload_core.streaming.meter import DeviceWeightMeter


class LayerDriver(Protocol):
    """What a unit needs of the streamer that drives it (the engine's LayerStreamer)."""

    meter: DeviceWeightMeter

    def before_layer(self, layer: StreamedLayer) -> None: ...

    def after_layer(self, layer: StreamedLayer) -> None: ...


class StreamedLayer:
    """One layer under streaming: its host copy, its parameters, and its hooks' entry points."""

    def __init__(self, key: str, module: nn.Module, params: tuple[nn.Parameter, ...], host: HostLayer,
                 resident: bool, device: torch.device, streamer: LayerDriver):
        self.key = key
        self.module = module
        self.params = params
        self.host = host
        self.resident = resident
        self.position = -1  # in the ring's streamed order; set for streamed layers only
        self._placeholders = tuple(placeholder(device, p.dtype) for p in params)
        self._streamer = streamer
        # Any one non-empty parameter tells the meter which device allocation the layer is bound
        # to (all its views share one); None when the layer has no data (it counts nothing).
        self._witness = next((i for i, meta in enumerate(host.layout.tensors) if meta.extent), None)
        self._views: tuple[torch.Tensor, ...] | None = None  # what the parameters point at (None: placeholders)
        self._bound = False  # bound by the engine now (released with its views kept: False)

    @property
    def layout(self) -> LayerLayout:
        return self.host.layout

    @property
    def tier(self) -> HostingTier:
        return self.host.tier

    @property
    def nbytes(self) -> int:
        """Bytes this layer occupies on the device when materialized (its flat layout)."""
        return self.layout.nbytes

    def host_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.host.host_tensors()

    @property
    def materialized(self) -> bool:
        """Whether the engine holds this layer's weights on the device now (bound, not yet released)."""
        return self._bound

    def views(self, regions: Mapping[torch.dtype, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Each parameter's view of the device ``regions`` (shape and strides as the original)."""
        return tuple(tensor_view(regions[meta.dtype], meta) for meta in self.layout.tensors)

    def bind(self, views: tuple[torch.Tensor, ...], storage: tuple[int, int] | None = None) -> None:
        """Point every parameter at its device view (from :meth:`views`); already there (the same
        ``views`` object, kept since the last release), nothing is pointed again.

        ``storage``: the meter's key and bytes for the one allocation the views are of, when the
        caller owns it (the ring's window), so the meter does not look at the tensors at each bind.
        """
        if views is not self._views:
            self._point(views)
            self._views = views
        self._bound = True
        if self._witness is None:
            return  # no data: it counts nothing
        if storage is not None:
            self._streamer.meter.bind_storage(self, *storage)
        else:
            self._streamer.meter.bind(self, views[self._witness])

    def release(self, keep_views: bool = False) -> None:
        """The layer's weights leave the device's count; its parameters point back at the shared
        zero-element placeholder, unless ``keep_views`` (the ring, within a use: see the module's docstring)."""
        if keep_views and self._views is not None:
            self._bound = False
            self._streamer.meter.release(self, kept=self.params)
            return
        self.drop_views()
        self._bound = False
        self._streamer.meter.release(self)

    def drop_views(self) -> None:
        """Point the parameters back at the placeholder if a release kept their views (no-op otherwise)."""
        if self._views is None:
            return
        self._point(self._placeholders)
        self._views = None
        self._streamer.meter.views_dropped(self)

    def _point(self, tensors: Sequence[torch.Tensor]) -> None:
        for param, tensor in zip(self.params, tensors):
            param.data = tensor

    def pre_forward(self, *_hook_args) -> None:
        """The layer module's forward pre-hook (``_hook_args``: the module and its inputs, unused)."""
        if torch.is_inference_mode_enabled():
            # A slot allocated (or a view made) inside a caller's inference_mode would be an
            # inference tensor, and the next copy into it from a forward under plain no_grad would
            # raise ("inplace update to inference tensor outside InferenceMode"): the engine's
            # tensors outlive any one forward, so they are made as normal tensors.
            with torch.inference_mode(False):
                self._streamer.before_layer(self)
        else:
            self._streamer.before_layer(self)

    def post_forward(self, *_hook_args) -> None:
        """The layer module's forward hook (``_hook_args``: the module, inputs and output, unused)."""
        self._streamer.after_layer(self)  # releases, records events, issues the next copies
