"""Within a use the ring keeps a released layer's views on its parameters; the use's end points them back.

A layer bound again at the same place (equal layers at depth 1: every forward of a denoise) points no
parameter; every parameter is a zero-element placeholder again once the use ends, whether the window
goes (finish_use) or stays (keep_resident); the meter's walk passes over kept views.
"""
from __future__ import annotations

import pytest
import torch

from offload_core.quant import WeightFormat, fake_quantize_
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from offload_core.streaming.unit import StreamedLayer
from tests.offload_core.tiny_models import WAN, Stack, wan_transformer


@pytest.fixture
def pointed(monkeypatch) -> list[str]:
    """The keys of the layers whose parameters were pointed anywhere (a view or a placeholder), in order."""
    calls: list[str] = []
    point = StreamedLayer._point

    def spy(self, tensors):
        calls.append(self.key)
        point(self, tensors)

    monkeypatch.setattr(StreamedLayer, "_point", spy)
    return calls


def _layer_params_empty(streamer) -> bool:
    return all(p.numel() == 0 for layer in streamer.layers for p in layer.params)


@pytest.mark.parametrize("weights,prefetch_depth,layers", [(WeightFormat.NATIVE, 1, 4), (WeightFormat.FP8, 2, 3)],
                         ids=["native_depth1", "fp8_depth2"])
def test_a_layer_bound_again_at_its_place_within_a_use_points_no_parameter(weights, prefetch_depth, layers, pointed,
                                                                            remove_after):
    # FP8: three layers in three slots take the same place every forward, while the two landing
    # buffers alternate, so a layer lands in the other buffer each forward: same views, other place key.
    model, reference, inputs = wan_transformer(layers), wan_transformer(layers), WAN.inputs()
    if weights is WeightFormat.FP8:
        fake_quantize_(list(reference.blocks))
    expected = WAN.run(reference, inputs)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=prefetch_depth,
                                                                                weights=weights)))
    assert len(streamer.layers) % streamer.ring.n_slots == 0, "each layer takes the same place every forward"
    assert weights is WeightFormat.NATIVE or all(layer.layout.quantized for layer in streamer.layers)
    streamer.prepare_for_use()
    first = WAN.run(model, inputs)
    assert sorted(set(pointed)) == sorted(layer.key for layer in streamer.layers)
    pointed.clear()
    second, third = WAN.run(model, inputs), WAN.run(model, inputs)
    assert pointed == [], f"pointed again within the use: {pointed}"
    streamer.finish_use()
    assert all(torch.equal(out, expected) for out in (first, second, third))


def test_released_layers_keep_their_views_within_a_use_and_count_nothing(remove_after):
    torch.manual_seed(0)
    model, x = Stack(depth=4), torch.randn(3, 8)
    # No wrap: after the last block's exit no layer is bound, yet every block still views the window.
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1, wrap_uses=False)))
    seen = []

    def after_exit(*_args):  # registered after the engine's forward hook: the block was just released
        seen.append((model.blocks[3].mix.numel() > 0, streamer.layers[3].materialized,
                     streamer.meter.current_bytes, streamer.meter.walk()))

    model.blocks[3].register_forward_hook(after_exit)
    with torch.no_grad():
        model(x)
    assert seen == [(True, False, streamer.non_layer_bytes, streamer.non_layer_bytes)], \
        "kept views, released, and neither the count nor the walk counts a released layer"


@pytest.mark.parametrize("keep_resident", [False, True])
def test_every_layer_parameter_is_a_placeholder_again_when_the_use_ends(keep_resident, remove_after):
    torch.manual_seed(0)
    model, x = Stack(depth=4), torch.randn(3, 8)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1,
                                                                                keep_resident=keep_resident)))
    with torch.no_grad():
        for _request in range(2):
            streamer.prepare_for_use()
            model(x)
            model(x)
            streamer.finish_use()
            assert _layer_params_empty(streamer), "a released layer still views the window after its use"
            assert streamer.meter.current_bytes == streamer.meter.walk()
    with pytest.raises(RuntimeError):
        model.blocks[1].forward(x)  # outside a use a released weight fails loudly, as before
