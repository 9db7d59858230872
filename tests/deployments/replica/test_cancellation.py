"""A cancelled Denoiser call stops at the next step boundary and frees the replica (in process:
the Denoiser class itself, cancelled the way Serve cancels it when the client disconnects); what
else its stream sends: nothing but the latents without progress, a preview only once its copy landed."""
from __future__ import annotations

import asyncio
import dataclasses
import pickle
import threading
import time

import pytest

from deployments.app import stage_configs
from deployments.models import steppers
from deployments.models.cancel import CancelFlag, RequestCancelled
from deployments.models.families import read_family_traits
from deployments.replica.stages import Denoiser, TextEncoder
from deployments.wire.spec import DenoiseProgress, GenerationSpec, PipelineStage
from tests.deployments.conftest import tiny_args
from zoo.tiny import ensure_tiny_wan

STEPS = 8
SPEC = GenerationSpec("cancel-me", "a slow river", None, 64, 64, 9, STEPS, 1.0, 3, 1)


@pytest.fixture(scope="module")
def stages():
    configs = stage_configs(tiny_args(), read_family_traits(ensure_tiny_wan()))
    encoder = TextEncoder.func_or_class(configs[PipelineStage.ENCODE])
    denoiser = Denoiser.func_or_class(configs[PipelineStage.DENOISE])
    try:
        yield encoder, denoiser
    finally:
        encoder.thread.close()
        encoder.worker.close()
        denoiser.worker.close()


async def _cancel_after_first_step(denoiser, encoded) -> tuple[int, float, float]:
    """(steps seen before the cancel, seconds per step, seconds from the cancel to a free replica)."""
    first_step = asyncio.Event()
    times: list[float] = []

    async def consume():
        async for item in denoiser.denoise(encoded, SPEC):
            assert isinstance(item, DenoiseProgress)
            times.append(time.perf_counter())
            first_step.set()

    started = time.perf_counter()
    task = asyncio.ensure_future(consume())
    await first_step.wait()
    task.cancel()  # what Serve does to the call when the client disconnects
    cancelled_at = time.perf_counter()
    with pytest.raises(asyncio.CancelledError):
        await task
    while denoiser.worker.busy:
        await asyncio.sleep(0.001)
    return len(times), times[0] - started, time.perf_counter() - cancelled_at


def test_a_cancelled_denoise_stops_at_the_next_step_boundary_and_frees_the_replica(stages):
    encoder, denoiser = stages
    encoded = asyncio.run(encoder.encode(SPEC))
    seen, step_s, freed_s = asyncio.run(_cancel_after_first_step(denoiser, encoded))
    flag = denoiser.last_cancelled
    assert flag is not None and flag.request_id == SPEC.request_id and flag.cancelled
    # Within one step of the disconnect: the batch ran at most the step it was in when cancelled
    # (the caller's last progress event may trail the batch by a step; the cancel is what counts).
    assert seen <= flag.cancelled_after_step
    assert flag.stopped_at_step is not None and flag.stopped_at_step <= flag.cancelled_after_step + 1 < STEPS
    assert not denoiser.worker.busy and denoiser.in_flight == {}
    print(f"step {step_s * 1e3:.0f} ms (first, with copies); replica free {freed_s * 1e3:.0f} ms after the cancel, "
          f"stopped after step {flag.stopped_at_step} of {STEPS}")
    # The replica serves the next request in full.
    async def whole():
        return [item async for item in denoiser.denoise(encoded, SPEC)]

    items = asyncio.run(whole())
    assert [p.step for p in items[:-1]] == list(range(1, STEPS + 1))


def test_without_progress_the_denoiser_sends_the_latents_alone(stages):
    encoder, denoiser = stages
    spec = GenerationSpec("quiet", "a still pond", None, 32, 32, 1, 2, 1.0, 5, 1)
    encoded = asyncio.run(encoder.encode(spec))

    async def run(progress: bool):
        return [item async for item in denoiser.denoise(encoded, spec, progress)]

    with_steps, alone = asyncio.run(run(True)), asyncio.run(run(False))
    assert [type(i).__name__ for i in with_steps] == ["DenoiseProgress", "DenoiseProgress", "StageOutput"]
    assert [type(i).__name__ for i in alone] == ["StageOutput"]
    assert alone[0].value.equal(with_steps[-1].value)


class _SlowCopy:
    """A CUDA copy's event that completes a while after the step that recorded it."""

    def __init__(self):
        self.landed = threading.Event()

    def synchronize(self) -> None:
        time.sleep(0.05)
        self.landed.set()


def test_a_preview_leaves_the_denoiser_only_after_its_copy_landed_and_crosses_without_its_event(stages,
                                                                                                 monkeypatch):
    encoder, denoiser = stages
    spec = GenerationSpec("preview", "a still pond", None, 32, 32, 1, 4, 1.0, 5, 1, partial_images=1)
    events = []

    def copy_with_event(tensor):
        events.append(_SlowCopy())
        return tensor.to("cpu", copy=True), events[-1]

    monkeypatch.setattr(steppers, "host_copy", copy_with_event)
    encoded = asyncio.run(encoder.encode(spec))

    async def run():
        seen = []
        async for item in denoiser.denoise(encoded, spec):
            if isinstance(item, DenoiseProgress) and item.preview is not None:
                seen.append((item.step, item.ready.landed.is_set()))
                wire = pickle.loads(pickle.dumps(item))  # as Serve sends it to the ingress
                assert wire.ready is None and wire.preview.equal(item.preview)
                assert (wire.request_id, wire.step, wire.total) == (item.request_id, item.step, item.total)
        return seen

    assert asyncio.run(run()) == [(2, True)] and len(events) == 1


def test_a_flag_stops_the_loop_only_once_set():
    flag = CancelFlag("r1")
    flag.raise_if_cancelled(1)
    flag.cancel("client left")
    with pytest.raises(RequestCancelled, match="after step 2: client left"):
        flag.raise_if_cancelled(2)
    assert flag.stopped_at_step == 2


def test_a_request_joins_a_batch_only_within_the_activations_its_busy_period_leased(stages):
    encoder, denoiser = stages
    encoded = asyncio.run(encoder.encode(SPEC))
    first = denoiser.stepper.start(encoded.value, SPEC)
    second = denoiser.stepper.start(encoded.value, dataclasses.replace(SPEC, request_id="second"))
    one = denoiser.worker.activation_bytes(SPEC)
    two = denoiser.worker.activation_bytes(SPEC, batch=2)
    assert 0 < one < two, "a batch of two needs more activations than one request"
    denoiser._leased_activation_bytes = one  # a busy period that leased room for one request
    assert denoiser._fits([first]) and not denoiser._fits([first, second])
    denoiser._leased_activation_bytes = two
    assert denoiser._fits([first, second])
