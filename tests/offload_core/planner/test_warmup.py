"""The warm-up: uses per request, compute per layer, and the order layers first ran in."""
from __future__ import annotations

from offload_core.planner.warmup import measure_warmup, profiles_from_warmup
from tests.offload_core.tiny_models import hunyuan_inputs, tiny_hunyuan

DECLARED_LAST = ("transformer_blocks", "single_transformer_blocks", "context_embedder.refiner_blocks")


def test_the_warmup_profiles_layers_in_the_order_they_ran_with_their_uses():
    model = tiny_hunyuan(DECLARED_LAST)
    inputs = hunyuan_inputs()

    def request():
        for _ in range(3):  # three denoising steps
            model(**inputs)

    figures = measure_warmup({"dit": model}, request)["dit"]
    assert figures.uses == 3
    assert figures.order[:2] == ("context_embedder.refiner_blocks.0", "context_embedder.refiner_blocks.1")
    assert "single_transformer_blocks.1" not in figures.order, "a GELU has no compute to stream behind"
    assert len(figures.layer_s) == len(figures.order) == 7 and all(t > 0 for t in figures.layer_s)
    (profile,) = profiles_from_warmup({"dit": model}, {"dit": figures})
    assert tuple(layer.key for layer in profile.layers) == figures.order
    assert profile.compute_s_per_layer == figures.layer_s and profile.uses_per_request == 3
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()), "the warm-up leaves no hook"
