"""Step-level batching: requests joining at different steps share forwards, each stays its own.

Reference for bitwise equality: the plain (unstreamed) transformer run on the same batch
composition at every step (the same ``StepBatch`` driven through the same boundaries). Reference
within tolerance: each request run alone by the pipeline (``families.denoise``).
"""
from __future__ import annotations

import pytest
import torch

from deployments.models import families
from deployments.models.cancel import RequestCancelled
from deployments.models.steppers import BatchKey, StepRequest, stepper_for
from deployments.replica.batching import BatchingConfig, QueueTimeout, StepBatch, StepBatcher
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core import StreamingConfig, apply_layer_streaming
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan

F32, CPU = torch.float32, torch.device("cpu")
# Batched kernels may sum in another order than batch-1 kernels: the difference from the request
# run alone is rounding, measured at < 1e-5 on the tiny zoo (fp32); 1e-4 leaves a margin.
ALONE_ATOL = 1e-4


def _pipes(folder):
    facts = families.read_family_traits(folder)
    return (facts, families.load_stage_pipeline(facts, PipelineStage.ENCODE, F32),
            families.load_stage_pipeline(facts, PipelineStage.DENOISE, F32))


def _wan_specs():
    # Different prompts, seeds, step counts, guidance scales (one unguided would change the key,
    # so all are guided here); sizes equal so they share a key.
    return [GenerationSpec("a", "a red fox", "blurry", 16, 16, 1, 4, 5.0, 1, 1),
            GenerationSpec("b", "a blue bird", None, 16, 16, 1, 3, 3.0, 2, 2),
            GenerationSpec("c", "a green frog", "dark", 16, 16, 1, 2, 7.5, 3, 1)]


def _flux_specs():
    return [GenerationSpec("a", "a lighthouse", None, 16, 16, 1, 4, 3.5, 1, 1),
            GenerationSpec("b", "a harbour", None, 16, 16, 1, 3, 2.0, 2, 1),
            GenerationSpec("c", "a boat", None, 16, 16, 1, 2, 5.0, 3, 2)]


def _run_staggered(stepper, encoded, specs, joins=(0, 1, 2)):
    """Request i joins before boundary ``joins[i]``; returns each request's latents."""
    batch = StepBatch(stepper, BatchingConfig(max_batch=4))
    futures, boundary = {}, 0
    while len(futures) < len(specs) or not batch.idle:
        for i, spec in enumerate(specs):
            if joins[i] == boundary:
                futures[spec.request_id] = batch.submit(stepper.start(encoded[i], spec))
        batch.step()
        boundary += 1
    return {rid: f.result() for rid, f in futures.items()}, batch


def _materialize(model):
    """Each weight in a fresh allocation, as on a real device: CPU kernels pick paths by a tensor's
    alignment, and from_pretrained leaves weights as views of the safetensors mapping."""
    for param in model.parameters():
        param.data = param.data.clone()


@pytest.fixture
def streamed_transformer():
    streamers = []

    def stream(pipe):
        streamers.append(apply_layer_streaming(pipe.transformer, CPU, StreamingConfig(prefetch_depth=1)))
        return streamers[-1]

    yield stream
    for streamer in streamers:
        streamer.remove()


@pytest.mark.parametrize("folder, specs", [(ensure_tiny_wan, _wan_specs), (ensure_tiny_flux, _flux_specs)],
                         ids=["wan", "flux"])
def test_requests_joining_at_different_steps_equal_the_plain_model_on_the_same_batches(
        folder, specs, streamed_transformer):
    facts, encoder, denoiser = _pipes(folder())
    specs = specs()
    encoded = [families.encode(encoder, facts, s, CPU) for s in specs]
    _materialize(denoiser.transformer)
    plain, plain_batch = _run_staggered(stepper_for(denoiser, facts, CPU), encoded, specs)

    _, _, streamed_pipe = _pipes(folder())
    _materialize(streamed_pipe.transformer)
    streamer = streamed_transformer(streamed_pipe)
    streamed, streamed_batch = _run_staggered(stepper_for(streamed_pipe, facts, CPU), encoded, specs)

    for spec in specs:
        assert torch.equal(streamed[spec.request_id], plain[spec.request_id]), spec.request_id
        alone = families.denoise(denoiser, facts, encoded[specs.index(spec)], spec, CPU)
        assert streamed[spec.request_id].shape == alone.shape
        torch.testing.assert_close(streamed[spec.request_id], alone, rtol=0, atol=ALONE_ATOL)
    # Steps: a 4 + b 3 + c 2 = 9 request-steps, served by 4 forwards (a's four boundaries).
    assert streamed_batch.forwards == plain_batch.forwards == 4
    assert streamed_batch.request_steps == 9
    # One stream of the weights per forward, whatever the batch size, plus the next forward's first
    # layers that the byte window (prefetch depth 1: room for two of the largest layer) copies ahead
    # once the last layer is done: layer 0, and layer 1 where it fits (equal layers: Wan).
    layer_bytes = sum(layer.nbytes for layer in streamer.layers)
    wrapped = streamer.bytes_copied - streamed_batch.forwards * layer_bytes
    assert wrapped in [sum(layer.nbytes for layer in streamer.layers[:k]) for k in (1, 2)], wrapped


def test_progress_is_reported_per_request_with_its_own_step_count():
    facts, encoder, denoiser = _pipes(ensure_tiny_wan())
    stepper = stepper_for(denoiser, facts, CPU)
    specs = _wan_specs()[:2]
    events = []
    batch = StepBatch(stepper)
    for spec in specs:
        batch.submit(stepper.start(families.encode(encoder, facts, spec, CPU), spec, on_step=events.append))
    while not batch.idle:
        batch.step()
    assert [(e.request_id, e.step, e.total) for e in events if e.request_id == "a"] == [("a", i, 4) for i in (1, 2, 3, 4)]
    assert [(e.request_id, e.step, e.total) for e in events if e.request_id == "b"] == [("b", i, 3) for i in (1, 2, 3)]


def test_a_cancelled_request_leaves_at_the_next_boundary_and_the_others_finish():
    facts, encoder, denoiser = _pipes(ensure_tiny_wan())
    stepper = stepper_for(denoiser, facts, CPU)
    specs = _wan_specs()[:2]
    encoded = [families.encode(encoder, facts, s, CPU) for s in specs]
    batch = StepBatch(stepper)
    requests = [stepper.start(e, s) for e, s in zip(encoded, specs)]
    futures = [batch.submit(r) for r in requests]
    batch.step()
    requests[0].cancel.cancel("client left")
    assert batch.step() == 1, "the cancelled request must not be in the next forward"
    with pytest.raises(RequestCancelled):
        futures[0].result(timeout=0)
    while not batch.idle:
        batch.step()
    alone = families.denoise(denoiser, facts, encoded[1], specs[1], CPU)
    torch.testing.assert_close(futures[1].result(timeout=0), alone, rtol=0, atol=ALONE_ATOL)
    assert requests[0].step == 1


class _FakeStepper:
    """Requests with a chosen key and step count; the forward returns zeros (no model)."""

    class _Scheduler:
        def step(self, noise, t, latents, return_dict=False):
            return (latents + 1,)

    def start(self, rid: str, steps: int, shape=(2,), rows=1) -> StepRequest:
        spec = GenerationSpec(rid, "p", None, 16, 16, 1, steps, 1.0, 0, rows)
        key = BatchKey(shape, F32, 4, False)
        return StepRequest(spec, key, self._Scheduler(), torch.zeros(steps), torch.zeros(rows, *shape), {}, None)

    def forward(self, batch):
        self.sizes.append([r.spec.request_id for r in batch])
        return [torch.zeros_like(r.latents) for r in batch]

    def __init__(self):
        self.sizes = []


def test_a_full_batch_and_an_incompatible_head_make_later_requests_wait_in_fifo_order():
    stepper = _FakeStepper()
    batch = StepBatch(stepper, BatchingConfig(max_batch=2))
    batch.submit(stepper.start("a", 2))
    batch.submit(stepper.start("b", 1))
    batch.submit(stepper.start("c", 1, shape=(3,)))  # another latent shape: cannot join a or b
    batch.submit(stepper.start("d", 1))  # compatible with a, but behind c in the queue
    while not batch.idle:
        batch.step()
    assert stepper.sizes == [["a", "b"], ["a"], ["c"], ["d"]]


def test_the_activation_lease_bounds_the_rows_in_a_batch():
    stepper = _FakeStepper()
    batch = StepBatch(stepper, BatchingConfig(max_batch=8), fits=lambda batch: sum(r.rows for r in batch) <= 3)
    for rid in "abc":
        batch.submit(stepper.start(rid, 1, rows=2 if rid == "a" else 1))
    while not batch.idle:
        batch.step()
    assert stepper.sizes == [["a", "b"], ["c"]]


def test_a_request_that_waits_past_max_wait_fails_with_queue_timeout():
    stepper, now = _FakeStepper(), [0.0]
    batch = StepBatch(stepper, BatchingConfig(max_batch=1, max_wait_s=5.0), clock=lambda: now[0])
    first = batch.submit(stepper.start("a", 3))
    second = batch.submit(stepper.start("b", 1))
    batch.step()
    now[0] = 6.0
    batch.step()
    with pytest.raises(QueueTimeout, match="max_wait_s"):
        second.result(timeout=0)
    while not batch.idle:
        batch.step()
    assert torch.equal(first.result(timeout=0), torch.full((1, 2), 3.0))


def test_an_idle_replica_gathers_for_at_most_a_tenth_of_its_last_forward():
    now = [0.0]

    class _TimedStepper(_FakeStepper):
        forward_s = 0.005  # the tiny Wan's forward: a 10 ms gather would double its denoise stage

        def forward(self, batch):
            now[0] += self.forward_s
            return super().forward(batch)

    stepper = _TimedStepper()
    batch = StepBatch(stepper, BatchingConfig(gather_s=0.01), clock=lambda: now[0])
    assert batch.gather_wait_s() == 0.01  # nothing measured yet: the configured gather
    batch.submit(stepper.start("a", 1))
    batch.step()
    assert batch.gather_wait_s() == pytest.approx(0.0005)
    stepper.forward_s = 1.0  # a streamed FLUX.1-dev forward: the configured 10 ms again
    batch.submit(stepper.start("b", 1))
    batch.step()
    assert batch.gather_wait_s() == 0.01


def test_the_batcher_thread_serves_concurrent_submissions_and_closes_cleanly():
    stepper = _FakeStepper()
    busy_periods = []

    def around_busy(run):
        busy_periods.append("start")
        run()

    batcher = StepBatcher(StepBatch(stepper, BatchingConfig(max_batch=4)), around_busy)
    futures = [batcher.submit(stepper.start(str(i), 3)) for i in range(6)]
    results = [f.result(timeout=10) for f in futures]
    assert all(torch.equal(r, torch.full((1, 2), 3.0)) for r in results)
    assert max(len(s) for s in stepper.sizes) > 1, "concurrent requests never shared a forward"
    batcher.close()
    assert busy_periods, "the busy-period wrapper never ran"


def test_config_rejects_a_batch_maximum_below_one():
    with pytest.raises(ValueError, match="max_batch"):
        BatchingConfig(max_batch=0)
    with pytest.raises(ValueError, match="max_batch"):
        BatchingConfig(max_batch=True)
