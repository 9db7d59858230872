"""plan_hosting: one lease, net cost, demote-then-give-back, ranking by bytes x uses, staging, real scale.

The pin-order rules are tested with ``staging_buffers=0`` (the engine's ``staged_copies=False``), so
their byte figures are the rules' own; the staging buffers' charge has its own tests, and the
real-scale tests run with it.
"""
from __future__ import annotations

import copy

import pytest
import torch

from offload_core.host.budget import InProcessLedger, MemoryBudget
from offload_core.host.hosting import GiB, HostingPolicy, plan_hosting
from offload_core.host.on_host import ComponentOnHost, LayerOnHost, layers_on_host
from offload_core.host.tier import HostingTier
from offload_core.planner import real_models

PINNED, PAGEABLE, MAPPED = HostingTier.PINNED, HostingTier.PAGEABLE, HostingTier.MAPPED


def _policy(**fields) -> HostingPolicy:
    return HostingPolicy(staging_buffers=0, **fields)


def _mapped_layers(prefix: str, n: int, nbytes: int, resident: int = 0) -> tuple[LayerOnHost, ...]:
    return tuple(LayerOnHost(f"{prefix}.{i}", nbytes, nbytes, 0, resident=i >= n - resident) for i in range(n))


class RecordingLedger(MemoryBudget):
    """An InProcessLedger that records every request, to count how a plan asks."""

    def __init__(self, capacity: int):
        self.inner = InProcessLedger(capacity)
        self.asked: list[int] = []

    def request(self, nbytes, owner, priority=0.0, purpose=""):
        self.asked.append(nbytes)
        return self.inner.request(nbytes, owner, priority, purpose)

    def release(self, lease):
        self.inner.release(lease)

    def outstanding(self, owner=None):
        return self.inner.outstanding(owner)

    def capacity(self):
        return self.inner.capacity()


def test_one_lease_covers_pinned_and_pageable_together():
    # 3 layers pinned (cap 60 B) and 3 pageable want 120 B net; 100 B free. Asking per tier would
    # test 60 B pinned and 60 B pageable each against the same 100 B and take both.
    ledger = RecordingLedger(100)
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 6, 20), uses_per_request=50)
    plan = plan_hosting([comp], ledger, "replica-a", _policy(max_pinned_bytes=60))
    assert ledger.asked == [100], "exactly one request, for the plan's whole net cost"
    assert plan.lease.nbytes == plan.net_cost == 100 and ledger.leased() == 100
    tiers = plan.tiers_for("dit")
    assert [tiers[f"blocks.{i}"] for i in range(6)] == [PINNED] * 3 + [PAGEABLE] * 2 + [MAPPED]
    assert (plan.component("dit").pinned_bytes, plan.component("dit").pageable_bytes) == (60, 40)


def test_everything_wanted_gets_one_lease_when_it_fits():
    ledger = RecordingLedger(1000)
    plan = plan_hosting([ComponentOnHost("dit", _mapped_layers("blocks", 4, 50), 10)], ledger, "r", _policy())
    assert ledger.asked == [200] and set(plan.tiers_for("dit").values()) == {PINNED}
    assert ledger.outstanding("r") == (plan.lease,)
    plan.release(ledger)
    assert ledger.leased() == 0


def test_net_cost_counts_only_bytes_copied_out_of_a_mapping():
    # Fused / converted layers are anonymous already: consolidating them is a wash.
    anonymous = tuple(LayerOnHost(f"blocks.{i}", 50, 0, 50) for i in range(4))
    mixed = (LayerOnHost("layers.0", 100, 30, 70),)
    ledger = InProcessLedger(30)
    plan = plan_hosting([ComponentOnHost("dit", anonymous, 50), ComponentOnHost("enc", mixed, 1)], ledger, "r", _policy())
    assert set(plan.tiers_for("dit").values()) == {PINNED}, "a zero-net layer must never be demoted"
    assert plan.tiers_for("enc") == {"layers.0": PINNED}, "30 B net fits 30 B free (gross 100 B would not)"
    assert plan.net_cost == 30 and plan.lease.nbytes == 30
    assert plan.component("dit").net_cost == 0 and plan.component("dit").pinned_bytes == 200


def test_pins_are_given_back_from_the_tail_when_the_host_cannot_fit():
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 10, 10, resident=2), uses_per_request=50)
    ledger = InProcessLedger(35)
    plan = plan_hosting([comp], ledger, "r", _policy())
    tiers = plan.tiers_for("dit")
    assert [k for k, t in tiers.items() if t is PINNED] == ["blocks.0", "blocks.1", "blocks.2"], \
        "the head of the streamed order keeps its pins; resident layers are last in the pin order"
    assert all(t is MAPPED for k, t in tiers.items() if t is not PINNED)
    assert plan.lease.nbytes == 30 <= ledger.capacity()
    assert any("gave back pins: 7 layers" in r for r in plan.reasons)


def test_resident_layers_are_offered_pins_after_every_streamed_layer():
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 4, 10, resident=1), uses_per_request=5)
    plan = plan_hosting([comp], InProcessLedger(30), "r", _policy())
    assert plan.tiers_for("dit") == {"blocks.0": PINNED, "blocks.1": PINNED, "blocks.2": PINNED,
                                     "blocks.3": MAPPED}


def test_pageable_layers_are_demoted_before_any_pin_is_given_back():
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 6, 10), uses_per_request=50)
    plan = plan_hosting([comp], InProcessLedger(30), "r", _policy(max_pinned_bytes=30))
    assert [plan.tiers_for("dit")[f"blocks.{i}"] for i in range(6)] == [PINNED] * 3 + [MAPPED] * 3


def test_ranking_is_weight_bytes_times_uses_not_raw_bytes():
    # The encoder is bigger, but the denoiser moves 40 B x 50 steps per request vs 100 B x 1.
    dit = ComponentOnHost("dit", _mapped_layers("blocks", 4, 10), uses_per_request=50)
    enc = ComponentOnHost("enc", _mapped_layers("encoder.block", 2, 50), uses_per_request=1)
    plan = plan_hosting([enc, dit], InProcessLedger(40), "r", _policy())
    assert set(plan.tiers_for("dit").values()) == {PINNED}
    assert set(plan.tiers_for("enc").values()) == {MAPPED}
    assert [c.name for c in plan.components] == ["dit", "enc"] and plan.component("dit").rank == 1


@pytest.mark.parametrize("uses", [None, 0, 2.5])
def test_a_missing_uses_figure_is_an_error_not_a_fallback_to_bytes(uses):
    with pytest.raises(ValueError, match="uses_per_request"):
        ComponentOnHost("enc", _mapped_layers("encoder.block", 2, 50), uses_per_request=uses)


def test_streamed_layers_must_come_before_resident_ones():
    layers = (LayerOnHost("blocks.0", 10, 10, 0, resident=True), LayerOnHost("blocks.1", 10, 10, 0))
    with pytest.raises(ValueError, match="streamed first"):
        ComponentOnHost("dit", layers, 1)
    with pytest.raises(ValueError, match="must equal"):
        LayerOnHost("blocks.0", 10, 5, 4)


def test_a_refused_request_refits_to_what_the_ledger_reports_and_never_over_commits():
    class RacedLedger(RecordingLedger):
        """Another replica takes 50 B between the plan's look at available() and its request."""

        def request(self, nbytes, owner, priority=0.0, purpose=""):
            if not self.asked:
                self.inner.request(50, "other-replica")
            return super().request(nbytes, owner, priority, purpose)

    ledger = RacedLedger(100)
    plan = plan_hosting([ComponentOnHost("dit", _mapped_layers("blocks", 10, 10), 50)], ledger, "r", _policy())
    assert ledger.asked == [100, 50]
    assert plan.lease.nbytes == 50 and ledger.leased() == 100 == ledger.capacity()
    assert sum(t is PINNED for t in plan.tiers_for("dit").values()) == 5
    assert any("refused" in r for r in plan.reasons)


def test_ceiling_mapped_copies_nothing_and_pageable_pins_nothing():
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 3, 10) + (LayerOnHost("blocks.3", 10, 0, 10),), 5)
    mapped = plan_hosting([comp], InProcessLedger(1000), "a", _policy(ceiling=MAPPED))
    assert mapped.net_cost == 0
    assert mapped.tiers_for("dit") == {"blocks.0": MAPPED, "blocks.1": MAPPED, "blocks.2": MAPPED,
                                       "blocks.3": PAGEABLE}
    pageable = plan_hosting([comp], InProcessLedger(1000), "b", _policy(ceiling=PAGEABLE))
    assert set(pageable.tiers_for("dit").values()) == {PAGEABLE} and pageable.net_cost == 30


def test_one_info_line_per_component_with_counts_and_why(caplog):
    dit = ComponentOnHost("dit", _mapped_layers("blocks", 4, GiB), 50)
    enc = ComponentOnHost("enc", _mapped_layers("encoder.block", 2, GiB), 1)
    with caplog.at_level("INFO", logger="offload_core.host.hosting"):
        plan_hosting([dit, enc], InProcessLedger(2 * GiB), "r", _policy())
    lines = [r.getMessage() for r in caplog.records if r.name == "offload_core.host.hosting"]
    assert len(lines) == 2
    assert lines[0].startswith("hosting dit: 2 pinned (2.00 GiB), 0 pageable (0.00 GiB), 2 mapped (2.00 GiB)")
    assert "x 50 uses/request" in lines[0] and "2 pins given back" in lines[0]
    assert lines[1].startswith("hosting enc: 0 pinned") and "2 pins given back" in lines[1]


def test_facts_from_a_loaded_model_measure_mapped_bytes(tmp_path):
    from safetensors.torch import load_file, save_file

    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)]))
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    model.load_state_dict(load_file(str(tmp_path / "w.safetensors")), assign=True)
    model[0][2].weight = torch.nn.Parameter(model[0][2].weight.clone())  # copied out: anonymous
    facts = layers_on_host("m", model, ["0"], 1, resident_keys=["0.0"])
    assert [l.key for l in facts.layers] == ["0.1", "0.2", "0.0"], "streamed first, then resident"
    by_key = {l.key: l for l in facts.layers}
    assert by_key["0.1"].mapped_bytes == 8 * 8 * 4 + 8 * 4 and by_key["0.1"].anon_bytes == 0
    assert (by_key["0.2"].mapped_bytes, by_key["0.2"].anon_bytes) == (8 * 4, 8 * 8 * 4)
    # The engine's flat buffer aligns each tensor to 512 B: weight at 0, bias at 512, end 1024.
    assert by_key["0.1"].host_bytes == 1024 and by_key["0.1"].padding_bytes == 1024 - 288


# --- real scale, on the meta device -------------------------------------------------------------
# The case: a DiT of which 50.5 of 61.7 GiB are views of the checkpoint mapping (81.8 %),
# on a host with 5.3 GiB spendable. The real-size Wan2.1-14B DiT is 26.7 GiB in its published dtype
# (bf16, fp32 norms) and 53.3 GiB in fp32; the same mapped share and spendable figure apply.
MAPPED_SHARE = 50.5 / 61.7
SPENDABLE = int(5.3 * GiB)


@pytest.fixture(scope="module")
def wan14b():
    return (real_models.meta_component("wan2.1-t2v-14b", "transformer"),
            real_models.meta_component("wan2.1-t2v-14b", "text_encoder"),
            int(real_models.pipeline_defaults("wan2.1-t2v-14b")["num_inference_steps"]))


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["published", "fp32"])
def test_real_scale_dit_pins_some_layers_not_zero_when_the_whole_does_not_fit(wan14b, dtype):
    dit_model, enc_model, steps = wan14b
    if dtype is not None:
        # Module.to() casts in place: cast a copy (meta, so no memory) to keep the fixture intact.
        dit_model = copy.deepcopy(dit_model).to(dtype)
    dit = layers_on_host("transformer", dit_model, None, steps, mapped_fraction=MAPPED_SHARE)
    enc = layers_on_host("text_encoder", enc_model, None, 1, mapped_fraction=1.0)
    assert len(dit.layers) == 40
    assert dit.weight_bytes > (50 if dtype is torch.float32 else 25) * GiB
    ledger = InProcessLedger(SPENDABLE)
    plan = plan_hosting([enc, dit], ledger, "wan14b-replica")
    pinned = [k for k, t in plan.tiers_for("transformer").items() if t is PINNED]
    per_layer_net = dit.layers[0].consolidation_cost
    # Both components keep some layers mapped, so each holds two staging buffers of its largest layer.
    staging = sum(plan.component(name).staging_bytes for name in ("transformer", "text_encoder"))
    assert plan.component("transformer").staging_bytes == 2 * max(l.host_bytes for l in dit.layers)
    assert len(pinned) == (SPENDABLE - staging) // per_layer_net > 0, "pins what fits, not zero"
    assert pinned == [f"blocks.{i}" for i in range(len(pinned))]
    assert plan.component("transformer").rank == 1
    assert set(plan.tiers_for("text_encoder").values()) == {MAPPED}
    assert plan.lease.nbytes <= SPENDABLE and ledger.leased() <= ledger.capacity()


def test_real_scale_plan_with_room_for_the_dit_spends_the_rest_on_encoder_layers(wan14b):
    dit_model, enc_model, steps = wan14b
    dit = layers_on_host("transformer", dit_model, ["blocks"], steps, mapped_fraction=MAPPED_SHARE)
    enc = layers_on_host("text_encoder", enc_model, ["encoder.block"], 1, mapped_fraction=1.0)
    enc_staging = 2 * max(l.host_bytes for l in enc.layers)
    room = sum(l.consolidation_cost for l in dit.layers) + enc_staging + 2 * GiB
    plan = plan_hosting([enc, dit], InProcessLedger(room), "r")
    assert set(plan.tiers_for("transformer").values()) == {PINNED}
    assert plan.component("transformer").staging_bytes == 0, "an all-pinned component stages nothing"
    assert plan.component("text_encoder").staging_bytes == enc_staging
    enc_pins = sum(t is PINNED for t in plan.tiers_for("text_encoder").values())
    assert 0 < enc_pins < len(enc.layers) and plan.net_cost <= room


# --- the PINNED tier on this machine ------------------------------------------------------------
def test_padding_of_the_flat_buffer_is_charged_even_for_anonymous_layers():
    layers = (LayerOnHost("blocks.0", 1000, 0, 1000, padding_bytes=24),)
    plan = plan_hosting([ComponentOnHost("dit", layers, 5)], InProcessLedger(24), "r", _policy())
    assert plan.net_cost == 24 and plan.tiers_for("dit") == {"blocks.0": PINNED}
    starved = plan_hosting([ComponentOnHost("dit", layers, 5)], InProcessLedger(23), "r", _policy())
    assert starved.net_cost == 0 and starved.tiers_for("dit") == {"blocks.0": MAPPED}, \
        "left as it is, an anonymous layer costs nothing; consolidated it costs its padding"


def test_pinned_buffers_are_exact_size_and_allocated_pageable_without_cuda():
    from offload_core.host.pinned import allocate_host_buffer, free_host_buffer

    nbytes = 12 * 1024**2 + 7  # 12 MiB + 7 B: torch's pinned caching allocator would round to 16 MiB
    buffer = allocate_host_buffer(nbytes, pin=True, device=torch.device("cpu"))
    assert buffer.nbytes == buffer.data.numel() == nbytes
    assert not buffer.page_locked, "no CUDA: planned and accounted pinned, allocated pageable"
    free_host_buffer(buffer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA device")
def test_pinned_buffers_are_page_locked_at_exact_size_on_cuda():
    from offload_core.host.pinned import allocate_host_buffer, free_host_buffer

    nbytes = 12 * 1024**2 + 7
    buffer = allocate_host_buffer(nbytes, pin=True, device=torch.device("cuda"))
    assert buffer.page_locked and buffer.data.is_pinned() and buffer.data.numel() == nbytes
    free_host_buffer(buffer)
    assert not buffer.data.is_pinned()


def test_bad_policy_and_duplicate_components_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="max_pinned_bytes"):
        HostingPolicy(max_pinned_bytes=-1)
    with pytest.raises(TypeError, match="HostingTier"):
        HostingPolicy(ceiling="pinned")
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 2, 10), 5)
    with pytest.raises(ValueError, match="unique"):
        plan_hosting([comp, comp], InProcessLedger(100), "r")


def test_a_planners_wanted_tiers_are_ceilings_that_still_fit_the_host():
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 4, 10), 50)
    wanted = {"dit": {"blocks.0": PINNED, "blocks.1": PINNED, "blocks.2": PAGEABLE, "blocks.3": MAPPED}}
    roomy = plan_hosting([comp], InProcessLedger(100), "a", _policy(wanted=wanted))
    assert roomy.tiers_for("dit") == wanted["dit"] and roomy.net_cost == 30
    tight = plan_hosting([comp], InProcessLedger(15), "b", _policy(wanted=wanted))
    assert tight.tiers_for("dit") == {"blocks.0": PINNED, "blocks.1": MAPPED, "blocks.2": MAPPED,
                                      "blocks.3": MAPPED}, "pageable demoted first, then the tail pin"
    with pytest.raises(ValueError, match="do not have"):
        plan_hosting([comp], InProcessLedger(15), "c", HostingPolicy(wanted={"dit": {"blocks.9": PINNED}}))


# --- staging buffers ------------------------------------------------------------------------------
def test_a_component_with_a_pageable_or_mapped_layer_pays_two_staging_buffers_of_its_largest_layer():
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 3, 10) + (LayerOnHost("blocks.3", 30, 30, 0),), 5)
    plan = plan_hosting([comp], InProcessLedger(1000), "r", HostingPolicy(ceiling=MAPPED))
    assert plan.component("dit").staging_bytes == 2 * 30 == plan.net_cost == plan.lease.nbytes
    assert "staging 0.00 GiB pinned" in plan.component("dit").log_line()


def test_staging_is_sized_per_dtype_as_the_engine_carves_it():
    layers = (LayerOnHost("blocks.0", 110, 110, 0, flat_bytes=(("bf16", 100), ("f32", 10))),
              LayerOnHost("blocks.1", 80, 80, 0, flat_bytes=(("bf16", 50), ("f32", 30))))
    plan = plan_hosting([ComponentOnHost("dit", layers, 5)], InProcessLedger(1000), "r", HostingPolicy(ceiling=MAPPED))
    assert plan.component("dit").staging_bytes == 2 * (100 + 30), "per dtype the largest, not the largest layer"


def test_giving_a_pin_back_adds_the_staging_buffers_the_component_now_needs():
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 4, 10), 50)
    everything = plan_hosting([comp], InProcessLedger(40), "a")
    assert set(everything.tiers_for("dit").values()) == {PINNED} and everything.net_cost == 40
    # 39 B: one pin back would cost 30 + 20 staging = 50; it takes three back (10 + 20 = 30).
    tight = plan_hosting([comp], InProcessLedger(39), "b")
    assert [tight.tiers_for("dit")[f"blocks.{i}"] for i in range(4)] == [PINNED, MAPPED, MAPPED, MAPPED]
    assert tight.net_cost == tight.lease.nbytes == 10 + 20


def test_a_host_that_cannot_hold_even_the_staging_buffers_is_a_clear_error():
    from offload_core.host.hosting import HostingError

    comp = ComponentOnHost("dit", _mapped_layers("blocks", 4, 10), 50)
    with pytest.raises(HostingError, match="staging buffers"):
        plan_hosting([comp], InProcessLedger(19), "r")
    with pytest.raises(ValueError, match="staging_buffers"):
        HostingPolicy(staging_buffers=-1)


def test_a_planners_wider_staging_ring_is_leased_for_its_component_only():
    dit = ComponentOnHost("dit", _mapped_layers("blocks", 4, 30), 50)
    enc = ComponentOnHost("enc", _mapped_layers("layers", 4, 10), 1)
    plan = plan_hosting([dit, enc], InProcessLedger(1000), "r", HostingPolicy(ceiling=MAPPED, staging={"dit": 4}))
    assert (plan.component("dit").staging_bytes, plan.component("dit").staging_buffers) == (4 * 30, 4)
    assert (plan.component("enc").staging_bytes, plan.component("enc").staging_buffers) == (2 * 10, 2)
    assert plan.net_cost == plan.lease.nbytes == 4 * 30 + 2 * 10


def test_a_short_host_narrows_a_wider_staging_ring_before_it_moves_any_tier():
    comp = ComponentOnHost("dit", _mapped_layers("blocks", 4, 30), 50)
    # Pageable layers cost 120 B and a 4-buffer ring 120 B; 200 B fit them with 2 buffers (60 B).
    plan = plan_hosting([comp], InProcessLedger(200), "r",
                        HostingPolicy(ceiling=PAGEABLE, staging={"dit": 4}))
    assert set(plan.tiers_for("dit").values()) == {PAGEABLE}, "no layer demoted: the ring gave way first"
    assert (plan.component("dit").staging_buffers, plan.net_cost) == (2, 120 + 60)
    assert any("narrowed the staging rings of dit to 2 buffers" in reason for reason in plan.reasons)
    with pytest.raises(ValueError, match="staging buffers per component"):
        HostingPolicy(staging={"dit": 0})
