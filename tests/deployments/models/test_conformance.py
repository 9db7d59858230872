"""The bar every family adapter meets, in-process on its tiny zoo model (seconds per family).

- staged (encoder, Denoiser, decoder pipelines loaded apart) is bitwise the in-process ``pipe(...)``
  with the same seed, for what users send: the service's default request (no negative prompt, the
  family's default guidance), a negative prompt where the family takes one (a 400 naming the field
  where it does not), quoted text for a family with a glyph encoder;
- a lone default request through the Denoiser's step batcher (the service's path) is the pipeline's
  output too;
- step-batched requests that join at different steps are bitwise the plain transformer(s) run on the
  same batch composition, with the weights streamed, and within rounding of each request alone;
- the activation model is within 10 % on a held-out shape, every stage;
- the fewest steps a family accepts make finite frames (fewer: a 400 naming the field);
- ``/v1/models`` states what the adapter declares;
- family-specific bad input is a 400 naming the field.

Adding a family: its module in deployments/models/, its zoo entry, and one line in ``CASES``.
"""
from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from PIL import Image

from deployments.api.images.edits import ImageEditRequest, edit_spec
from deployments.api.images.protocol import ImageRequest, image_spec
from deployments.api.model_list import model_card
from deployments.api.videos.protocol import VideoRequest, video_spec
from deployments.capacity.request_limits import FieldError, Limits
from deployments.models import activation_features as activations
from deployments.models import families
from deployments.models.adapter import ReferenceImage
from deployments.models.registry import adapter_for
from deployments.replica.batching import BatchingConfig, StepBatch
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core import StreamingConfig, apply_layer_streaming
from offload_core.residency.activation_meter import measure_activations
from tests.deployments.models.in_context import through_a_step_batch
from zoo import tiny, tiny_families, wan22

CPU, F32 = torch.device("cpu"), torch.float32
ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE
# Batched kernels may sum in another order than batch-1 kernels: measured < 1e-5 on the tiny zoo (fp32).
ALONE_ATOL = 1e-4


@dataclass(frozen=True)
class Case:
    """One family's zoo model and the step count its checks run (enough to reach every expert)."""

    name: str
    folder: Callable[[], Path]
    steps: int = 2
    image: bool = False  # requests carry a reference image (always, for a family that requires one)
    glyphs: bool = False  # a glyph encoder renders quoted text (HunyuanVideo 1.5's ByT5)
    # The pipeline runs guidance's two branches as two forwards where the step batcher runs one of
    # twice the rows: other kernels' summation order, so within one level of 255, not bitwise.
    joins_branches: bool = False


CASES = [
    Case("wan2.1", tiny.ensure_tiny_wan, joins_branches=True),
    Case("flux", tiny.ensure_tiny_flux),
    Case("flux-kontext", tiny.ensure_tiny_flux_kontext),
    Case("flux-kontext+image", tiny.ensure_tiny_flux_kontext, image=True),
    Case("wan2.2-a14b", wan22.ensure_tiny_wan22_a14b, steps=4, joins_branches=True),  # 999, 900 high noise; 750, 500 low
    Case("wan2.2-ti2v-5b", wan22.ensure_tiny_wan22_ti2v, joins_branches=True),
    Case("wan2.2-ti2v-5b+image", wan22.ensure_tiny_wan22_ti2v, image=True, joins_branches=True),
    Case("wan2.2-i2v-a14b", wan22.ensure_tiny_wan22_i2v, steps=4, joins_branches=True),
    Case("wan2.1-i2v", wan22.ensure_tiny_wan21_i2v, joins_branches=True),
    Case("sd3.5", tiny_families.ensure_tiny_sd3),
    Case("z-image", tiny_families.ensure_tiny_zimage),
    Case("qwen-image", tiny_families.ensure_tiny_qwen_image),
    Case("qwen-image-edit", tiny_families.ensure_tiny_qwen_image_edit, image=True),
    Case("hunyuan-video-1.5", tiny_families.ensure_tiny_hunyuan15, glyphs=True, joins_branches=True),
    Case("hunyuan-video-1.5-i2v", tiny_families.ensure_tiny_hunyuan15_i2v, image=True, joins_branches=True),
]
IDS = [c.name for c in CASES]
# The cases whose folders edit images (tests/deployments/models/test_edits.py pins each bitwise).
EDITING = {"wan2.1", "flux", "sd3.5", "z-image", "qwen-image"}
# ... and those that edit in context, not by img2img (test_flux_kontext.py, test_qwen_image_edit.py).
IN_CONTEXT = {"flux-kontext", "flux-kontext+image", "qwen-image-edit"}
INPAINTING = {"flux", "sd3.5", "z-image", "qwen-image"}
GLYPH_CASES = [c for c in CASES if c.glyphs]


def reference_png(side: int = 16, colour=(200, 40, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(out, format="PNG")
    return out.getvalue()


class Family:
    """A case's facts, one pipeline per stage and the full pipeline, loaded once per case."""

    def __init__(self, case: Case):
        self.case = case
        self.facts = families.read_family_traits(case.folder())
        self.pipes = {s: families.load_stage_pipeline(self.facts, s, F32) for s in PipelineStage}

    def spec(self, rid="a", prompt="a red fox", seed=1, n=1, guidance=None, side=None, frames=None,
             negative=None) -> GenerationSpec:
        """The service's default request (no negative prompt, the family's default guidance) unless told."""
        facts = self.facts
        n = min(n, facts.max_n or n)  # a family that makes one output per request (max_n) gets 1
        side = side or facts.size_multiple
        frames = frames or (1 + facts.temporal_factor if facts.supports_video else 1)
        image = reference_png(side) if facts.reference_image is ReferenceImage.REQUIRED or self.case.image else None
        guidance = facts.default_guidance if guidance is None else guidance
        return GenerationSpec(rid, prompt, negative, side, side, frames, self.case.steps, guidance, seed, n, image)

    def encoded(self, spec):
        encoded = families.encode(self.pipes[ENCODE], self.facts, spec, CPU).packed().unpacked()
        condition = families.condition(self.pipes[DECODE], self.facts, spec, CPU)
        return encoded if condition is None else dataclasses.replace(encoded, image_condition=condition)


_LOADED: dict[str, Family] = {}


@pytest.fixture(params=CASES, ids=IDS)
def family(request) -> Family:
    case = request.param
    if case.name not in _LOADED:
        _LOADED.clear()  # one family's pipelines in memory at a time
        _LOADED[case.name] = Family(case)
    return _LOADED[case.name]


def _route(facts):
    """(spec maker, request class) of the route that serves the family: generations, edits (an edit-only
    family: the image is the reference), or videos."""
    if "image" in facts.modalities:
        return image_spec, ImageRequest
    if "image-edit" in facts.modalities:
        def edit(req, facts, limits, model_id, reference=None):
            body = {**req.model_dump(exclude_unset=True), "image": reference or reference_png(facts.size_multiple)}
            return edit_spec(ImageEditRequest.model_validate(body), facts, limits, model_id)
        return edit, ImageRequest
    return video_spec, VideoRequest


def _staged(family, spec) -> torch.Tensor:
    latents = families.denoise(family.pipes[DENOISE], family.facts, family.encoded(spec), spec, CPU)
    return families.decode(family.pipes[DECODE], family.facts, latents, spec, CPU)


def _reference(family, spec) -> torch.Tensor:
    return families.reference_frames(families.load_full_pipeline(family.facts, F32), family.facts, spec)


def test_the_default_request_staged_is_bitwise_the_in_process_pipeline(family):
    spec = family.spec(n=2)
    staged = _staged(family, spec)
    assert staged.shape == (spec.n, spec.num_frames, spec.height, spec.width, 3)
    assert torch.equal(staged, _reference(family, spec))


def test_a_negative_prompt_staged_is_bitwise_the_in_process_pipeline_given_it(family):
    facts = family.facts
    if not facts.supports_negative_prompt:  # refused at the API, naming the field
        limits = Limits(default_size=f"{facts.size_multiple}x{facts.size_multiple}")
        make, request = _route(facts)
        with pytest.raises(FieldError) as refused:
            make(request(prompt="a cat", negative_prompt="blurry"), facts, limits, "m")
        assert refused.value.param == "negative_prompt" and refused.value.status == 400
        return
    spec = family.spec(negative="blurry")
    staged = _staged(family, spec)
    assert torch.equal(staged, _reference(family, spec))
    assert not torch.equal(staged, _staged(family, family.spec())), "the negative prompt changes the result"


@pytest.mark.parametrize("case", GLYPH_CASES, ids=[c.name for c in GLYPH_CASES])
def test_quoted_text_runs_the_glyph_encoder_and_is_bitwise_the_in_process_pipeline(case):
    family = _LOADED.get(case.name) or Family(case)
    spec = family.spec(prompt='a shop sign that reads "OPEN"')
    encoded = family.encoded(spec)
    assert encoded.prompt_embeds_mask_2.any(), "the glyph encoder ran for the quoted text"
    assert not family.encoded(family.spec()).prompt_embeds_mask_2.any(), "and not without quotes"
    assert torch.equal(_staged(family, spec), _reference(family, spec))


def test_a_lone_default_request_through_the_step_batcher_is_the_in_process_pipelines_output(family):
    facts, spec = family.facts, family.spec()
    stepper = adapter_for(facts).stepper(family.pipes[DENOISE], facts, CPU)
    latents, _ = _staggered(stepper, [family.encoded(spec)], [spec])
    frames = families.decode(family.pipes[DECODE], facts, latents[spec.request_id], spec, CPU)
    reference = _reference(family, spec)
    if not family.case.joins_branches:
        assert torch.equal(frames, reference)
        return
    levels = ((frames * 255).round() - (reference * 255).round()).abs().max().item()  # the delivered 8-bit pixels
    assert levels <= 1, f"{family.case.name}: {levels} levels off the pipeline"


def test_previews_are_the_flow_estimate_of_the_final_latents_and_change_nothing(family):
    facts = family.facts
    spec = dataclasses.replace(family.spec(), steps=4, partial_images=3)
    stepper, encoded = adapter_for(facts).stepper(family.pipes[DENOISE], facts, CPU), family.encoded(spec)
    plain = through_a_step_batch(stepper, stepper.start(encoded, spec))
    seen, last = [], {}
    request = stepper.start(encoded, spec, on_step=seen.append)
    advance = request.advance

    def recording(noise_pred):  # the last step's input, to ask for its estimate after it
        last.update(sample=request.latents, noise_pred=noise_pred)
        advance(noise_pred)

    request.advance = recording
    assert torch.equal(through_a_step_batch(stepper, request), plain), "previews change the result"
    assert [p.step for p in seen if p.preview is not None] == [1, 2, 3]
    for progress in seen:
        if progress.preview is not None:
            assert progress.preview.shape == plain.shape and torch.isfinite(progress.preview).all()
    frames = families.decode(family.pipes[DECODE], facts, seen[0].preview, spec, CPU)
    assert frames.shape == (spec.n, spec.num_frames, spec.height, spec.width, 3) and torch.isfinite(frames).all()
    # The estimate after the last step is where the scheduler's last step lands (its next sigma is 0):
    # the sigma read is the one the step used.
    assert torch.allclose(request.preview(last["sample"], last["noise_pred"])[0], plain, atol=1e-5)


def _staggered(stepper, encoded, specs):
    """Request i joins before boundary i; each request's latents, and the batch."""
    batch, futures, boundary = StepBatch(stepper, BatchingConfig(max_batch=4)), {}, 0
    while len(futures) < len(specs) or not batch.idle:
        if boundary < len(specs):
            futures[specs[boundary].request_id] = batch.submit(stepper.start(encoded[boundary], specs[boundary]))
        batch.step()
        boundary += 1
    return {rid: f.result() for rid, f in futures.items()}, batch


def _fresh(pipe, facts):
    """Each weight in its own allocation (from_pretrained leaves views of the file mapping; CPU
    kernels pick paths by alignment), as on a real device."""
    for name in facts.experts:
        for param in getattr(pipe, name).parameters():
            param.data = param.data.clone()
    return pipe


def test_step_batches_are_bitwise_the_plain_model_on_the_same_batches(family):
    facts = family.facts
    specs = [family.spec("a", "a red fox", 1), family.spec("b", "a blue bird", 2, guidance=facts.default_guidance + 1),
             family.spec("c", "a green frog", 3, n=2)]
    encoded = [family.encoded(s) for s in specs]
    plain_pipe = _fresh(family.pipes[DENOISE], facts)
    plain, plain_batch = _staggered(families.adapter_for(facts).stepper(plain_pipe, facts, CPU), encoded, specs)
    streamed_pipe = _fresh(families.load_stage_pipeline(facts, DENOISE, F32), facts)
    streamers = [apply_layer_streaming(getattr(streamed_pipe, n), CPU, StreamingConfig(prefetch_depth=1))
                 for n in facts.experts]
    try:
        stepper = adapter_for(facts).stepper(streamed_pipe, facts, CPU)
        streamed, batch = _staggered(stepper, encoded, specs)
    finally:
        for streamer in streamers:
            streamer.remove()
    for spec, enc in zip(specs, encoded):
        assert torch.equal(streamed[spec.request_id], plain[spec.request_id]), spec.request_id
        alone = families.denoise(plain_pipe, facts, enc, spec, CPU)
        torch.testing.assert_close(streamed[spec.request_id], alone, rtol=0, atol=ALONE_ATOL)
    assert batch.forwards == plain_batch.forwards
    if len(facts.experts) == 2:
        # Requests a step apart straddle the boundary: the same step runs each expert's own forward.
        assert set(stepper.forwards_by_expert) == set(facts.experts)
        assert all(n > 0 for n in stepper.forwards_by_expert.values())
        assert sum(stepper.forwards_by_expert.values()) > batch.forwards


def _peak(family, stage, spec, image: bool = True) -> int:
    """``spec``'s measured activation peak in ``stage``, with the case's reference image (``image``) or without."""
    facts, pipe = family.facts, family.pipes[stage]
    spec = dataclasses.replace(spec, reference_image=family.spec().reference_image if image else None)
    weights = [t for m in families.stage_modules(pipe, facts, stage).values() for t in (*m.parameters(), *m.buffers())]
    value = activations.stage_input(pipe, facts, stage, spec)
    _, measured = measure_activations(lambda: activations.run_stage(pipe, facts, stage, spec, CPU, value), CPU, weights)
    return measured.peak_bytes


def test_the_activation_model_is_within_10_percent_on_a_held_out_shape(family):
    facts, m = family.facts, family.facts.size_multiple
    for stage in PipelineStage:  # each stage calibrates on its own shapes, as its replica's warm-up does
        shapes = activations.calibration_shapes(facts, stage=stage)
        # As the replica's warm-up: with a stand-in image where the family requires one, else from text alone.
        required = facts.reference_image is ReferenceImage.REQUIRED
        fitted = activations.calibrate_stage(facts, stage, shapes, lambda s: _peak(family, stage, s, required), 4)
        for regime in {activations.regime(s) for s in shapes}:
            frames = 1 if regime is activations.Regime.IMAGE else 1 + 2 * facts.temporal_factor
            # Guided as the calibration is (a negative prompt where the family takes one): the shape is held out.
            held = dataclasses.replace(family.spec(frames=frames), height=-(-32 // m) * m, width=-(-48 // m) * m,
                                       steps=facts.min_steps, n=min(2 if frames > 1 else 1, facts.max_n or 2),
                                       negative_prompt=shapes[0].negative_prompt)
            predicted, measured = fitted.predict(held), _peak(family, stage, held)
            assert abs(predicted - measured) <= 0.10 * measured, (
                f"{stage.value} {regime.value}: predicted {predicted} B, measured {measured} B")


def test_the_fewest_steps_a_family_accepts_make_finite_frames_and_fewer_are_a_400(family):
    facts, limits = family.facts, Limits(default_size=f"{family.facts.size_multiple}x{family.facts.size_multiple}")
    fewest = dataclasses.replace(family.spec(), steps=facts.min_steps)
    assert torch.isfinite(_staged(family, fewest)).all(), f"{facts.min_steps} step(s) made NaN frames"
    make, request = _route(facts)
    reference = fewest.reference_image if facts.reference_image is ReferenceImage.REQUIRED else None
    assert make(request(prompt="a cat", num_inference_steps=facts.min_steps), facts, limits, "m",
                reference).steps == facts.min_steps
    if facts.min_steps > 1:  # Qwen-Image: its scheduler's shift_terminal makes a 1-step schedule NaN
        with pytest.raises(FieldError) as refused:
            make(request(prompt="a cat", num_inference_steps=facts.min_steps - 1), facts, limits, "m", reference)
        assert refused.value.param == "num_inference_steps" and refused.value.status == 400
        assert "shift_terminal" in str(refused.value)


def test_v1_models_states_what_the_adapter_declares(family):
    facts = family.facts
    card = model_card("m", facts, Limits(default_size=f"{facts.size_multiple}x{facts.size_multiple}"), ())
    assert card.family == facts.family.value and card.size_multiple == facts.size_multiple
    index = json.loads((Path(facts.folder) / "model_index.json").read_text())
    assert card.modalities == list(adapter_for(facts).modalities(index))
    assert ("image-edit" in card.modalities) == (family.case.name in EDITING | IN_CONTEXT), "the editing families"
    assert ("image-inpaint" in card.modalities) == (family.case.name in INPAINTING), "and those that take a mask"
    assert ("video-edit" in card.modalities) == (family.case.name == "wan2.1"), "and the one that remixes videos"
    assert card.min_steps == facts.min_steps == (2 if family.case.name.startswith("qwen-image") else 1)
    assert card.max_images == facts.max_images == (3 if family.case.name == "qwen-image-edit" else 1)
    # Configured limits (no replica reported): the longest video the VAE makes within 81 frames.
    assert card.limits.frames == (1 + (81 - 1) // facts.temporal_factor * facts.temporal_factor
                                  if facts.supports_video else 1)


def test_family_specific_bad_input_is_a_400_naming_the_field(family):
    facts = family.facts
    limits = Limits(default_size=f"{facts.size_multiple}x{facts.size_multiple}")
    reference = reference_png(facts.size_multiple)
    if not facts.supports_video:
        with pytest.raises(FieldError) as refused:
            video_spec(VideoRequest(prompt="a cat"), facts, limits, "m")
        assert refused.value.param == "model" and refused.value.status == 400
    else:
        with pytest.raises(FieldError) as refused:
            video_spec(VideoRequest(prompt="a cat", num_frames=facts.temporal_factor), facts, limits, "m", reference)
        assert refused.value.param == "num_frames" and refused.value.status == 400
    if facts.reference_image is ReferenceImage.NONE:
        if "image" not in facts.modalities and "image-edit" in facts.modalities:  # it edits only: no generations
            with pytest.raises(FieldError) as refused:
                image_spec(ImageRequest(prompt="a cat"), facts, limits, "m")
            assert refused.value.param == "model" and "/v1/images/edits" in refused.value.message
        else:
            with pytest.raises(FieldError) as refused:  # on the route the family serves (a video-only one: videos)
                if "image" in facts.modalities:
                    image_spec(ImageRequest(prompt="a cat"), facts, limits, "m", reference)
                else:
                    video_spec(VideoRequest(prompt="a cat"), facts, limits, "m", reference)
            assert refused.value.param == "input_reference" and facts.family.value in refused.value.message
    elif facts.reference_image is ReferenceImage.REQUIRED:
        with pytest.raises(FieldError) as refused:
            video_spec(VideoRequest(prompt="a cat"), facts, limits, "m")
        assert refused.value.param == "input_reference" and "required" in refused.value.message
    else:  # optional: a video may start from one, an image may not
        with pytest.raises(FieldError) as refused:
            image_spec(ImageRequest(prompt="a cat"), facts, limits, "m", reference)
        assert refused.value.param == "input_reference" and "videos only" in refused.value.message
        assert video_spec(VideoRequest(prompt="a cat"), facts, limits, "m", reference).reference_image == reference


def test_qwen_image_default_request_is_what_qwen_image_pipeline_gives_a_user_who_calls_it_directly():
    """64x64, 2 steps, guidance 4.0, no negative prompt: the pipeline does not guide without one (it
    warns), so neither does the service (it once guided on " ": 1,666 pixels differed by up to 2)."""
    family = _LOADED.get("qwen-image") or Family(next(c for c in CASES if c.name == "qwen-image"))
    spec = dataclasses.replace(family.spec(side=64), guidance_scale=4.0)
    pipe = families.load_full_pipeline(family.facts, F32)
    user = torch.from_numpy(pipe(prompt=spec.prompt, height=64, width=64, num_inference_steps=spec.steps,
                                 true_cfg_scale=4.0, generator=torch.Generator().manual_seed(spec.seed),
                                 output_type="np").images).unsqueeze(1)
    assert torch.equal(_staged(family, spec), user)
    latents, _ = _staggered(adapter_for(family.facts).stepper(family.pipes[DENOISE], family.facts, CPU),
                            [family.encoded(spec)], [spec])
    assert torch.equal(families.decode(family.pipes[DECODE], family.facts, latents[spec.request_id], spec, CPU), user)
