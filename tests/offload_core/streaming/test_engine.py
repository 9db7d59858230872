"""The layer streamer on CPU: bitwise equality, what is materialized when, peak bytes, init, errors."""
from __future__ import annotations

import pytest
import torch

from offload_core.buffers import RegionMap
from offload_core.host.tier import HostingTier
from offload_core.layout import align_up, declared_layer_groups, resolve_layer_group
from offload_core.streaming.engine import (
    AlreadyStreamedError,
    ResidentPlacement,
    StreamingConfig,
    apply_layer_streaming,
)
from tests.offload_core.tiny_models import ALL_CASES, FLUX, WAN, Stack

RESIDENCY = {
    "none": dict(resident=0),
    "one_leading": dict(resident=1, resident_placement=ResidentPlacement.LEADING),
    "half_strided": dict(resident=0.5, resident_placement=ResidentPlacement.STRIDED),
    "all": dict(resident=1.0),
}


def _materialized_keys(streamer) -> set[str]:
    return {layer.key for layer in streamer.layers if layer.materialized}


@pytest.mark.parametrize("residency", sorted(RESIDENCY))
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_streamed_output_is_bitwise_equal_over_two_requests(case, depth, residency, remove_after):
    model, inputs = case.build(), case.inputs()
    expected = case.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=depth, **RESIDENCY[residency])))
    assert _materialized_keys(streamer) == set(), "loading must not materialize any layer on the device"

    first = case.run(model, inputs)  # armed lazily by the first forward
    streamer.finish_use()
    assert _materialized_keys(streamer) == set(), "finish_use must release every layer"
    streamer.prepare_for_use()
    second = case.run(model, inputs)
    streamer.finish_use()

    assert torch.equal(first, expected)
    assert torch.equal(second, expected)
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    assert streamer.meter.current_bytes == streamer.non_layer_bytes


class _Window:
    """The prefetch window as the engine is meant to fill it, replayed independently: each layer's
    bytes after the last placed (at 0 if they do not fit before the end), never over a held layer,
    in order; an emptied window starts again at 0."""

    def __init__(self, streamer, depth: int):
        streamed = [layer for layer in streamer.layers if not layer.resident]
        self.keys = [layer.key for layer in streamed]
        self.sizes = [RegionMap.covering([layer.layout]).nbytes for layer in streamed]
        self.size = min(depth + 1, len(streamed)) * RegionMap.covering(layer.layout for layer in streamed).nbytes
        self.head, self.held = 0, {}

    def _place(self, p: int) -> bool:
        start = self.head if self.head + self.sizes[p] <= self.size else 0
        end = start + self.sizes[p]
        if any(start < b and a < end for a, b in self.held.values()):
            return False
        self.held[p], self.head = (start, end), end
        return True

    def enter(self, k: int) -> None:
        if k not in self.held:
            self.held, self.head = {}, 0
            self._place(k)

    def exit(self, k: int) -> None:
        del self.held[k]
        if not self.held:
            self.head = 0
        n = len(self.sizes)
        for step in range(n):
            p = (k + 1 + step) % n
            if p not in self.held and not self._place(p):
                return

    def materialized(self) -> set[str]:
        return {self.keys[p] for p in self.held}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_at_each_hook_exactly_the_expected_layers_are_materialized(case, depth, remove_after):
    model, inputs = case.build(), case.inputs()
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=depth, resident=1)))
    resident = {layer.key for layer in streamer.layers if layer.resident}
    window = _Window(streamer, depth)
    seen = []

    def check(layer_key, phase):
        k = window.keys.index(layer_key)
        # pre: the layer is there (copied now on a cold start); post: the engine's post-hook freed
        # its bytes and issued the layers after it, as far as the window holds them
        window.enter(k) if phase == "pre" else window.exit(k)
        expected = resident | window.materialized()
        seen.append((layer_key, phase))
        materialized = _materialized_keys(streamer)
        assert materialized == expected, f"{phase}-hook of {layer_key}: {sorted(materialized)} != {sorted(expected)}"

    for layer in streamer.layers:
        if layer.resident:
            continue
        layer.module.register_forward_pre_hook(lambda *_, k=layer.key: check(k, "pre"))
        layer.module.register_forward_hook(lambda *_, k=layer.key: check(k, "post"))
    case.run(model, inputs)
    case.run(model, inputs)  # the second step starts from the wrapped prefetch
    n_streamed = sum(1 for layer in streamer.layers if not layer.resident)
    assert len(seen) == 2 * 2 * n_streamed
    assert len(window.held) > 1, "the wrapped prefetch holds more than the next layer"


def test_flux_layers_run_across_groups_in_group_order(remove_after):
    model = FLUX.build()
    streamer = remove_after(apply_layer_streaming(model, "cpu"))
    order = []
    for layer in streamer.layers:
        layer.module.register_forward_pre_hook(lambda *_, k=layer.key: order.append(k))
    FLUX.run(model, FLUX.inputs())
    assert order == [layer.key for layer in streamer.layers]
    assert order == ["transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0",
                     "single_transformer_blocks.1", "single_transformer_blocks.2"]


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _aligned_layer_bytes(layer: torch.nn.Module) -> int:
    """Independent of the engine: one flat buffer per dtype, every tensor at a 512-byte offset."""
    per_dtype: dict = {}
    for p in layer.parameters():
        per_dtype[p.dtype] = align_up(per_dtype.get(p.dtype, 0)) + p.numel() * p.element_size()
    return sum(align_up(n) for n in per_dtype.values())


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 1), (1, 4)])
def test_measured_peak_equals_non_layer_plus_resident_plus_slots(depth, resident, remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    blocks = list(model.blocks)
    layer_bytes = [_aligned_layer_bytes(b) for b in blocks]
    layer_ids = {id(p) for b in blocks for p in b.parameters()}
    non_layer = _param_bytes(p for p in model.parameters() if id(p) not in layer_ids)
    streamed = layer_bytes[resident:]
    slots = min(depth + 1, len(streamed)) * max(streamed, default=0)
    formula = non_layer + sum(layer_bytes[:resident]) + slots

    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=depth, resident=resident)))
    assert streamer.predicted_peak_bytes() == formula
    WAN.run(model, inputs)
    assert streamer.meter.peak_bytes == formula


def test_multi_group_init_calls_to_once_with_every_layer_weight_a_placeholder(monkeypatch, remove_after):
    model = FLUX.build()
    layer_params = [p for path in declared_layer_groups(model)
                    for layer in resolve_layer_group(model, path).layers for p in layer.parameters()]
    original_to = model.to
    calls = []

    def spy_to(*args, **kwargs):
        calls.append([p.numel() for p in layer_params])
        return original_to(*args, **kwargs)

    monkeypatch.setattr(model, "to", spy_to)
    consolidated = []
    from offload_core.streaming import host_layer

    original_consolidate = host_layer.HostLayer.consolidate.__func__

    def spy_consolidate(cls, layout, *args, **kwargs):
        consolidated.append(layout.key)
        return original_consolidate(cls, layout, *args, **kwargs)

    monkeypatch.setattr(host_layer.HostLayer, "consolidate", classmethod(spy_consolidate))
    remove_after(apply_layer_streaming(model, "cpu"))
    assert len(calls) == 1, f"model.to was called {len(calls)} times; a later group would move twice"
    assert all(n == 0 for n in calls[0]), "a layer weight was still materialized when model.to ran"
    # Group bytes from the layouts (the parameters are placeholders by now).
    streamer = model._offload_layer_streamer
    group_bytes = {path: sum(l.nbytes for l in streamer.layers if l.key.startswith(path + "."))
                   for path in declared_layer_groups(model)}
    assert len(set(group_bytes.values())) == 2, "the groups must differ in size for the order to show"
    largest = max(group_bytes, key=group_bytes.get)
    assert consolidated[0].startswith(largest + "."), f"moved {consolidated[0]} first; largest group is {largest}"


def test_bytes_copied_counts_every_layer_copy_of_a_request(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1, resident=1)))
    layer_bytes = streamer.layers[0].nbytes  # Wan blocks are all the same size
    streamer.prepare_for_use()
    WAN.run(model, inputs)
    # 1 resident + 3 streamed + the wrapped prefetch of the next step's first 2 streamed layers
    # (the window holds 2; the last layer's exit issues both, its place freed)
    assert streamer.bytes_copied == 6 * layer_bytes
    streamer.reset_counters()
    assert streamer.bytes_copied == 0


def test_keep_resident_keeps_resident_layers_across_requests(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(resident=2, keep_resident=True)))
    WAN.run(model, inputs)
    streamer.finish_use()
    assert _materialized_keys(streamer) == {"blocks.0", "blocks.1"}
    streamer.reset_counters()
    assert torch.equal(WAN.run(model, inputs), expected)
    # the 2 streamed layers, then both again wrapped for the next step: resident ones not at all
    assert streamer.bytes_copied == 4 * streamer.layers[0].nbytes, "resident layers were copied again"
    streamer.finish_use(keep_resident=False)
    assert _materialized_keys(streamer) == set()


def test_strided_residents_are_spread_evenly(remove_after):
    model = WAN.build()
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(
        resident=2, resident_placement=ResidentPlacement.STRIDED)))
    assert [layer.key for layer in streamer.layers if layer.resident] == ["blocks.0", "blocks.2"]


def test_a_device_copy_never_aliases_its_host_buffer(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(resident=1)))
    host_ranges = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes())
                   for layer in streamer.layers for t in layer.host_tensors()]
    checked = []

    def check(*_):
        for layer in streamer.layers:
            for p in layer.params:
                if p.numel():
                    start = p.untyped_storage().data_ptr()
                    end = start + p.untyped_storage().nbytes()
                    assert all(end <= lo or start >= hi for lo, hi in host_ranges), f"{layer.key} aliases a host buffer"
                    checked.append(p)

    for layer in streamer.layers:
        layer.module.register_forward_pre_hook(check)
    WAN.run(model, inputs)
    assert checked


def test_mapped_layers_stream_from_the_safetensors_mapping_without_a_host_copy(tmp_path, remove_after):
    from safetensors.torch import load_file, save_file

    model, inputs = WAN.build(), WAN.inputs()
    path = tmp_path / "wan.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    model.load_state_dict(load_file(str(path)), assign=True)
    # The reference is the plain model as loaded: views of the mapping sit at 8-byte offsets, and
    # CPU kernels may round differently on unaligned weights than on freshly allocated ones.
    expected = WAN.run(model, inputs)
    originals = {f"blocks.{i}.{n}": p.data_ptr() for i, b in enumerate(model.blocks) for n, p in b.named_parameters()}
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(
        hosting={f"blocks.{i}": HostingTier.MAPPED for i in range(4)})))

    mapped = _file_mappings(path)
    for layer in streamer.layers:
        assert layer.tier is HostingTier.MAPPED and layer.host.nbytes == 0
        ptrs = [t.data_ptr() for t in layer.host_tensors()]
        assert ptrs == [originals[f"{layer.key}.{m.name}"] for m in layer.layout.tensors], "host tensors were copied"
        assert all(any(lo <= p < hi for lo, hi in mapped) for p in ptrs), "host tensors left the file mapping"
    assert torch.equal(WAN.run(model, inputs), expected)
    assert torch.equal(WAN.run(model, inputs), expected)


def _file_mappings(path) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(str(path)):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def test_pinned_and_pageable_layers_are_consolidated_into_one_buffer_per_dtype(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(hosting={"blocks.0": HostingTier.PINNED})))
    tiers = [layer.tier for layer in streamer.layers]
    assert tiers == [HostingTier.PINNED] + [HostingTier.PAGEABLE] * 3
    for layer in streamer.layers:
        assert len(layer.host_tensors()) == len(layer.layout.dtypes) == 1
        assert layer.host_tensors()[0].numel() == layer.nbytes
    assert torch.equal(WAN.run(model, inputs), expected)


def test_non_contiguous_parameters_keep_their_strides(remove_after):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    expected = model(x)
    strides = [b.mix.stride() for b in model.blocks]
    assert strides[0] == (1, 8)
    streamer = remove_after(apply_layer_streaming(model, "cpu"))
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, _args: seen.append(module.mix.stride()))
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert seen == strides
    streamer.finish_use()
    assert all(not layer.materialized for layer in streamer.layers)


def test_a_released_weight_used_without_the_hooks_fails_loudly(remove_after):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    remove_after(apply_layer_streaming(model, "cpu"))
    block = model.blocks[1]
    with pytest.raises(RuntimeError):
        block.forward(x)  # forward() bypasses the hooks
    with pytest.raises(RuntimeError):
        x * block.scale  # a (1,) placeholder would broadcast here; a zero-element one cannot


def test_remove_gives_back_a_plain_model(remove_after):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    expected = model(x)
    streamer = remove_after(apply_layer_streaming(model, "cpu"))
    streamer.remove()
    assert not hasattr(model, "_offload_layer_streamer")
    assert torch.equal(model(x), expected)
    assert all(p.numel() > 0 for p in model.parameters())
    remove_after(apply_layer_streaming(model, "cpu"))  # and it can be streamed again


def test_a_removed_streamer_stops_counting_in_cpu_headroom_while_the_model_lives(cpu_capacity, remove_after):
    from offload_core.streaming.device import get_device

    cpu_capacity(1 << 30)
    device = get_device("cpu")
    before = device.headroom_bytes()
    model, x = Stack(), torch.randn(3, 8)
    streamer = remove_after(apply_layer_streaming(model, "cpu"))
    model(x)
    assert device.headroom_bytes() < before, "a streamed model's device weights count against headroom"
    streamer.remove()
    assert device.headroom_bytes() == before, "remove() must untrack the meter, not leave it to the GC"


def test_removing_a_streamer_twice_leaves_the_plain_model(remove_after):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    streamer = remove_after(apply_layer_streaming(model, "cpu"))
    streamer.remove()
    streamer.remove()  # a replica closed, then collected: the second call must not touch the model
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_a_model_already_under_streaming_is_refused(remove_after):
    model = Stack()
    remove_after(apply_layer_streaming(model, "cpu"))
    with pytest.raises(AlreadyStreamedError, match="already under layer streaming"):
        remove_after(apply_layer_streaming(model, "cpu"))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(prefetch_depth=0), ValueError, "prefetch_depth"),
    (dict(resident=-1), ValueError, "resident count"),
    (dict(resident=1.5), ValueError, "fraction"),
    (dict(resident=True), TypeError, "resident"),
    (dict(layer_groups="blocks"), TypeError, "layer_groups"),
    (dict(layer_groups=()), ValueError, "layer_groups"),
    (dict(hosting={"blocks.0": "pinned"}), TypeError, "HostingTier"),
])
def test_bad_config_is_refused_with_the_field_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        StreamingConfig(**kwargs)


def test_hosting_for_a_layer_that_is_not_streamed_is_refused(remove_after):
    with pytest.raises(ValueError, match="blocks.9"):
        remove_after(apply_layer_streaming(Stack(), "cpu", StreamingConfig(hosting={"blocks.9": HostingTier.PINNED})))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the same code runs on CPU above)")
@pytest.mark.parametrize("tier", [HostingTier.PINNED, HostingTier.PAGEABLE, HostingTier.MAPPED])
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_streamed_output_is_bitwise_equal_on_cuda(case, tier, remove_after):
    model, inputs = case.build(), case.inputs()
    expected = case.run(model.to("cuda"), {k: v.to("cuda") for k, v in inputs.items()})
    model.to("cpu")
    keys = [f"{p}.{i}" for p in declared_layer_groups(model) for i in range(len(resolve_layer_group(model, p).layers))]
    streamer = remove_after(apply_layer_streaming(model, "cuda", StreamingConfig(prefetch_depth=2, resident=1,
                                                                     hosting={k: tier for k in keys})))
    cuda_inputs = {k: v.to("cuda") for k, v in inputs.items()}
    for _ in range(2):
        streamer.prepare_for_use()
        out = case.run(model, cuda_inputs)
        streamer.finish_use()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()


class Failing(Exception):
    pass


def test_a_layer_that_raises_is_released_and_the_next_request_is_exact(remove_after):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    streamer = remove_after(apply_layer_streaming(model, "cpu"))

    def boom(*_):
        raise Failing("layer 2 failed")

    handle = model.blocks[2].linear.register_forward_pre_hook(boom)
    with pytest.raises(Failing), torch.no_grad():
        model(x)
    assert "blocks.2" not in _materialized_keys(streamer), "the failing layer must be released"
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    streamer.finish_use()
    assert _materialized_keys(streamer) == set()


def test_a_second_thread_entering_a_running_layer_is_refused(remove_after):
    import threading

    from offload_core.streaming.engine import ConcurrentForwardError

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    streamer = remove_after(apply_layer_streaming(model, "cpu"))
    inside, release = threading.Event(), threading.Event()

    def hold(*_):
        inside.set()
        release.wait(10)

    handle = model.blocks[1].linear.register_forward_pre_hook(hold)
    results = {}

    def first():
        with torch.no_grad():
            results["first"] = model(x)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    with pytest.raises(ConcurrentForwardError, match="serialize forwards"), torch.no_grad():
        model(x)
    release.set()
    thread.join(10)
    handle.remove()
    assert torch.equal(results["first"], expected), "the refused forward disturbed the running one"
    streamer.finish_use()


def test_buffers_stay_on_the_device_and_only_parameters_stream(remove_after):
    model = Stack()
    shifts = [b.shift for b in model.blocks]
    streamer = remove_after(apply_layer_streaming(model, "cpu"))
    assert all(b.shift is s and b.shift.numel() == 8 for b, s in zip(model.blocks, shifts))
    assert all(len(layer.params) == 4 for layer in streamer.layers)


def test_a_resident_count_above_the_layer_count_makes_every_layer_resident(caplog, remove_after):
    import logging

    with caplog.at_level(logging.INFO, logger="offload_core.streaming.engine"):
        streamer = remove_after(apply_layer_streaming(Stack(depth=3), "cpu", StreamingConfig(resident=5)))
    assert all(layer.resident for layer in streamer.layers) and streamer.ring.n_slots == 0
    assert "resident=5 asked, only 3 layers" in caplog.text


def test_a_failed_host_allocation_leaves_the_model_as_it_was(monkeypatch, remove_after):
    from offload_core.streaming import host_layer

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    real_allocate = host_layer.allocate_host_buffer
    calls = []

    def fail_third(nbytes, *, pin, device):
        calls.append(nbytes)
        if len(calls) == 3:
            raise MemoryError("host allocation of 2048 B failed")
        return real_allocate(nbytes, pin=pin, device=device)

    monkeypatch.setattr(host_layer, "allocate_host_buffer", fail_third)
    with pytest.raises(MemoryError):
        remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(hosting={f"blocks.{i}": HostingTier.PINNED for i in range(4)})))
    assert not hasattr(model, "_offload_layer_streamer")
    assert all(p.numel() > 0 for p in model.parameters()), "a layer was left on its placeholder"
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    monkeypatch.setattr(host_layer, "allocate_host_buffer", real_allocate)
    remove_after(apply_layer_streaming(model, "cpu"))
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_streaming_under_inference_mode_then_no_grad_stays_exact(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(resident=1, keep_resident=True)))
    with torch.inference_mode():  # views made here are inference tensors, reused under no_grad below
        assert torch.equal(model(**inputs, return_dict=False)[0], expected)
    assert torch.equal(WAN.run(model, inputs), expected)
    streamer.finish_use(keep_resident=False)


def test_mixed_dtype_layers_stream_one_flat_buffer_per_dtype(remove_after):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    for block in model.blocks[1:]:  # bf16 scales, fp32 matmuls: fp32 * bf16 promotes to fp32
        block.scale.data = block.scale.data.to(torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=2)))
    assert [layer.layout.dtypes for layer in streamer.layers] == [(torch.float32,)] + [(torch.bfloat16, torch.float32)] * 3
    assert [len(layer.host_tensors()) for layer in streamer.layers] == [1, 2, 2, 2]
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
