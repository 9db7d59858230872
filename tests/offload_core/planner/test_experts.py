"""Wan2.2 A14B's two experts: one runs per step, so the plan holds one expert's working set at a time."""
from __future__ import annotations

import pytest

from offload_core.planner.cli import expert_residency, main, plan_stage_bytes
from offload_core.planner.inputs import gpu_spec, real_model_facts
from offload_core.planner.search import PerformanceMode, plan_pipeline

GiB = 2**30
A14B = "wan2.2-t2v-a14b"


@pytest.fixture(scope="module")
def l4_facts():
    return real_model_facts(A14B, gpu_spec("L4"), 64 * GiB)


def test_each_expert_is_used_for_its_share_of_the_steps_at_the_sampling_shift(l4_facts):
    facts, notes = l4_facts
    uses = {c.name: c.uses_per_request for c in facts.components}
    # 40 steps at Wan2.2's sampling shift 12.0: 26 at t >= 875 on the high-noise expert; two passes each (guidance 4).
    assert (uses["transformer"], uses["transformer_2"]) == (52, 28)
    # The diffusers folder's scheduler writes 3.0: 13 high-noise steps.
    again, _ = real_model_facts(A14B, gpu_spec("L4"), 64 * GiB, flow_shift=3.0)
    assert {c.name: c.uses_per_request for c in again.components}["transformer"] == 26
    assert any("flow_shift 12" in n and "says 3: 13/27" in n for n in notes)


def test_the_image_to_video_a14b_plans_its_36_channel_experts_at_its_own_boundary_and_shift():
    facts, notes = real_model_facts("wan2.2-i2v-a14b", gpu_spec("L4"), 64 * GiB)
    uses = {c.name: c.uses_per_request for c in facts.components}
    # 40 steps at Wan2.2 I2V's sampling shift 5.0: 15 at t >= 900 on the high-noise expert; two passes (guidance 3.5).
    assert (uses["transformer"], uses["transformer_2"]) == (30, 50)
    assert any("timesteps >= 0.9 x 1000 at flow_shift 5" in n and "says 3: 11/29" in n for n in notes)
    t2v, _ = real_model_facts(A14B, gpu_spec("L4"), 64 * GiB)
    # The patch embedding takes 36 input channels (16 noise + 4 mask + 16 image latents), not 16.
    assert ({c.name: c.non_layer_bytes for c in facts.components}["transformer"]
            > {c.name: c.non_layer_bytes for c in t2v.components}["transformer"])


def test_the_peak_holds_one_experts_working_set_while_the_other_is_idle(l4_facts):
    facts, _ = l4_facts
    assert [s.name for s in facts.stages] == ["encode", "denoise:transformer", "denoise:transformer_2", "decode"]
    plan = plan_pipeline(facts, PerformanceMode.MEMORY)
    by = {c.name: c.prediction for c in plan.components}
    phases = {s.name: plan_stage_bytes(plan, s) for s in plan.stages}
    assert plan.peak_device_bytes == max(phases.values())
    for running, idle in (("transformer", "transformer_2"), ("transformer_2", "transformer")):
        # The running expert's working set, the idle one's parked remainder, the other stages' idle bytes.
        assert phases[f"denoise:{running}"] == sum(p.idle_bytes for n, p in by.items() if n != running) + \
            by[running].in_use_bytes
        assert by[idle].idle_bytes < by[idle].in_use_bytes, "the idle expert holds less than its working set"
    lines = expert_residency(plan)
    assert len(lines) == 2 and all("layerwise" in line for line in lines)


def test_the_plan_keeps_both_experts_resident_only_where_the_gpu_holds_both(capsys):
    # 2 x 26.7 GiB of bf16 experts and the 21.2 GiB encoder fit an H200 beside a 720p forward's 16 GiB of
    # activations: both stay. On an H100 they do not (75.0 GiB of weights beside 18.4 GiB kept for activations).
    assert main(["--model", A14B, "--gpu", "H200", "--host-ram", "256GiB", "--mode", "speed"]) == 0
    out = capsys.readouterr().out
    assert "while transformer runs, transformer_2 is resident: both experts on the device" in out
    assert ": feasible" in out.splitlines()[0]
    assert main(["--model", A14B, "--gpu", "H100", "--host-ram", "256GiB", "--mode", "speed"]) == 0
    assert ": INFEASIBLE" in capsys.readouterr().out.splitlines()[0]
    # On a 24 GiB GPU they cannot both be resident: the speed plan is infeasible, the memory plan streams both.
    facts, _ = real_model_facts(A14B, gpu_spec("RTX4090"), 64 * GiB)
    assert not plan_pipeline(facts, PerformanceMode.SPEED).feasible
    lean = plan_pipeline(facts, PerformanceMode.MEMORY)
    assert lean.feasible and {lean.component(e).strategy.value for e in ("transformer", "transformer_2")} == {"layerwise"}
