"""Image edits (deployments/models/edits.py) on each editing family's tiny zoo model, in-process.

Staged as the service runs an edit (the decoder stage encodes the image, the Denoiser's step batch
enters the schedule at the edit's first step) is bitwise the family's diffusers img2img pipeline (Wan:
WanVideoToVideoPipeline on a one-frame video) with the same seed; an edit batched beside a text-to-image
request of its shape is its result alone, within the batched kernels' rounding. Wan's pipeline runs
guidance's two branches as two forwards where the step batcher runs one of twice the rows: bitwise
unguided, within one 8-bit level guided (as tests/deployments/models/test_conformance.py holds it).
"""
from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from PIL import Image

from deployments.models import families
from deployments.models.registry import adapter_for
from deployments.replica.batching import BatchingConfig, StepBatch
from deployments.wire.spec import EditRule, EditSource, GenerationSpec, PipelineStage
from zoo import tiny, tiny_families

CPU, F32 = torch.device("cpu"), torch.float32
ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE
EDITING = {"flux": tiny.ensure_tiny_flux, "sd3.5": tiny_families.ensure_tiny_sd3, "wan2.1": tiny.ensure_tiny_wan,
           "z-image": tiny_families.ensure_tiny_zimage, "qwen-image": tiny_families.ensure_tiny_qwen_image}
JOINS_BRANCHES = {"wan2.1"}
# Where each rule enters a schedule of 4 steps: the steps run at strength 0.25, 0.6, 1.0.
RUN_STEPS = {EditRule.IMG2IMG: {0.25: 1, 0.6: 3, 1.0: 4}, EditRule.VIDEO2VIDEO: {0.25: 1, 0.6: 2, 1.0: 4}}
# Batched kernels may sum in another order than batch-1 kernels: measured < 1e-5 on the tiny zoo (fp32).
ALONE_ATOL = 1e-4


def a_photo(side: int) -> bytes:
    """An image with structure (a gradient and a square), so an edit that ignored it would show."""
    image = Image.new("RGB", (side, side))
    image.putdata([(8 * x % 256, 8 * y % 256, 128) for y in range(side) for x in range(side)])
    image.paste((250, 250, 20), (side // 4, side // 4, side // 2, side // 2))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class Editing:
    def __init__(self, name: str):
        self.name = name
        self.facts = families.read_family_traits(EDITING[name]())
        assert "image-edit" in self.facts.modalities
        self.pipes = {s: families.load_stage_pipeline(self.facts, s, F32) for s in PipelineStage}
        self.stepper = adapter_for(self.facts).stepper(self.pipes[DENOISE], self.facts, CPU)

    def spec(self, rid="e", steps=4, strength=0.6, n=1, seed=3, side=None, guidance=None) -> GenerationSpec:
        """An edit at the family's default guidance, or one branch where the pipeline's two would not be
        bitwise the step batch's one forward (``guidance``: else as given)."""
        side = side or 2 * self.facts.size_multiple
        if guidance is None:
            guidance = 1.0 if self.name in JOINS_BRANCHES else self.facts.default_guidance
        return GenerationSpec(rid, "a red fox", None, side, side, 1, steps, guidance, seed, n, a_photo(side),
                              strength=strength, edit_rule=self.facts.edit_rule)

    def request(self, spec: GenerationSpec, on_step=None):
        encoded = families.encode(self.pipes[ENCODE], self.facts, spec, CPU).packed().unpacked()
        request = self.stepper.start(encoded, spec, on_step=on_step)
        if spec.strength is not None:
            source = families.condition(self.pipes[DECODE], self.facts, spec, CPU)
            assert isinstance(source, EditSource)
            self.stepper.begin_edit(request, source)
        return request

    def decode(self, latents, spec) -> torch.Tensor:
        return families.decode(self.pipes[DECODE], self.facts, latents, spec, CPU)

    def reference(self, spec) -> torch.Tensor:
        return families.reference_frames(families.load_full_pipeline(self.facts, F32), self.facts, spec)


_LOADED: dict[str, Editing] = {}


@pytest.fixture(params=sorted(EDITING))
def editing(request) -> Editing:
    if request.param not in _LOADED:
        _LOADED.clear()
        _LOADED[request.param] = Editing(request.param)
    return _LOADED[request.param]


def run(batch: StepBatch) -> None:
    while not batch.idle:
        batch.step()


def test_an_edit_through_the_step_batcher_is_bitwise_the_familys_img2img_pipeline(editing):
    spec = editing.spec(n=2)
    seen = []
    batch = StepBatch(editing.stepper, BatchingConfig(max_batch=1))
    future = batch.submit(editing.request(spec, on_step=seen.append))
    run(batch)
    frames = editing.decode(future.result(), spec)
    assert frames.shape == (2, 1, spec.height, spec.width, 3)
    assert torch.equal(frames, editing.reference(spec))
    steps = RUN_STEPS[editing.facts.edit_rule][0.6]  # img2img: entered at int(4 - 2.4) = 1; Wan's at 4 - int(2.4)
    assert [p.step for p in seen] == list(range(1, steps + 1)) and {p.total for p in seen} == {spec.run_steps} == {steps}


def test_strength_enters_the_schedule_later_the_lower_it_is_and_each_is_the_pipelines_edit(editing):
    """The image is noised to the sigma of the step the edit enters at: 1 (noise alone; Wan's UniPC 1 - 1e-6) at strength 1,
    less the lower the strength, and the steps run are the rest of the schedule."""
    entered = {}
    for strength in (0.25, 0.6, 1.0):
        spec = editing.spec(steps=4, strength=strength)
        request = editing.request(spec)
        scheduler = request.scheduler
        entered[strength] = scheduler.sigmas[scheduler.begin_index].item()
        assert len(request.timesteps) == spec.run_steps == RUN_STEPS[editing.facts.edit_rule][strength]
        assert torch.equal(_staged(editing, spec), editing.reference(spec)), strength
    assert entered[0.25] < entered[0.6] < entered[1.0] and entered[1.0] == pytest.approx(1.0, abs=1e-5), entered


def _staged(editing, spec) -> torch.Tensor:
    batch = StepBatch(editing.stepper, BatchingConfig(max_batch=1))
    future = batch.submit(editing.request(spec))
    run(batch)
    return editing.decode(future.result(), spec)


def test_an_edit_batched_beside_a_text_to_image_request_is_its_result_alone(editing):
    edit, text = editing.spec(rid="edit"), dataclasses.replace(editing.spec(rid="text"), strength=None,
                                                               reference_image=None)
    alone = {s.request_id: _staged(editing, s) for s in (edit, text)}
    batch = StepBatch(editing.stepper, BatchingConfig(max_batch=2))
    futures = {s.request_id: batch.submit(editing.request(s)) for s in (text, edit)}
    run(batch)
    for rid, future in futures.items():
        spec = edit if rid == "edit" else text
        together = editing.decode(future.result(), spec)
        assert torch.allclose(together, alone[rid], atol=ALONE_ATOL, rtol=0), rid


def test_a_guided_wan_edit_is_the_video_to_video_pipeline_within_one_level():
    editing = _LOADED.get("wan2.1") or Editing("wan2.1")
    spec = editing.spec(guidance=editing.facts.default_guidance, n=2)
    frames, reference = _staged(editing, spec), editing.reference(spec)
    levels = ((frames * 255).round() - (reference * 255).round()).abs().max().item()  # the delivered 8-bit pixels
    assert spec.guidance_scale > 1 and levels <= 1, levels


def an_openai_mask(side: int) -> bytes:
    """OpenAI's mask: opaque everywhere but a transparent square (where the edit may repaint)."""
    mask = Image.new("RGBA", (side, side), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (side // 4, side // 2, 3 * side // 4, side))
    out = io.BytesIO()
    mask.save(out, format="PNG")
    return out.getvalue()


INPAINTING = ["flux", "sd3.5", "z-image", "qwen-image"]


@pytest.mark.parametrize("name", INPAINTING)
@pytest.mark.parametrize("strength", [0.6, 1.0])
def test_a_masked_edit_is_bitwise_the_familys_inpaint_pipeline_and_not_the_plain_edit(name, strength):
    editing = _LOADED.get(name) or Editing(name)
    assert "image-inpaint" in editing.facts.modalities
    plain = editing.spec(n=2, strength=strength)
    masked = dataclasses.replace(plain, mask_image=an_openai_mask(plain.width))
    frames = _staged(editing, masked)
    assert torch.equal(frames, editing.reference(masked))
    assert not torch.equal(frames, _staged(editing, plain)), "the mask keeps the image outside it"


@pytest.mark.parametrize("name", INPAINTING)
def test_a_masked_edits_previews_keep_the_image_outside_the_mask_as_its_final_latents_do(name):
    editing = _LOADED.get(name) or Editing(name)
    spec = dataclasses.replace(editing.spec(n=2, steps=4, strength=1.0), partial_images=2,
                               mask_image=an_openai_mask(2 * editing.facts.size_multiple))
    seen = []
    request = editing.request(spec, on_step=seen.append)
    batch = StepBatch(editing.stepper, BatchingConfig(max_batch=1))
    future = batch.submit(request)
    run(batch)
    final = future.result()
    # Outside the mask the kept value does not depend on the estimate: the image's latents.
    outside = request.keep(torch.zeros_like(final)) == request.keep(torch.ones_like(final))
    assert outside.any() and not outside.all()
    previews = [p.preview for p in seen if p.preview is not None]
    assert len(previews) == 2
    for preview in previews:
        assert torch.equal(preview[outside], final[outside]), "the image, as the final latents keep it"
        assert not torch.equal(preview[~outside], final[~outside]), "the model's estimate inside"


def a_video(frames: int, side: int) -> bytes:
    """An H.264 mp4 whose frames differ (a square moving across a gradient), as a finished job stores one."""
    from deployments.wire import media

    y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    video = torch.stack([(x / side), (y / side), torch.full((side, side), 0.5)], dim=-1).repeat(frames, 1, 1, 1)
    for f in range(frames):
        video[f, side // 4:side // 2, f * side // (2 * frames):f * side // (2 * frames) + side // 4] = 0.9
    return media.mp4_bytes(video, 4)


@pytest.mark.parametrize("strength, steps_run", [(0.6, 2), (1.0, 4)])
def test_a_video_edit_is_the_video_to_video_pipeline_on_the_mp4s_frames(strength, steps_run):
    """A remix (POST /v1/videos/{id}/remix): the finished video's mp4, decoded in the decoder stage, encoded
    by its VAE and noised to the edit's step is WanVideoToVideoPipeline's edit of the same frames, bitwise."""
    editing = _LOADED.get("wan2.1") or Editing("wan2.1")
    assert "video-edit" in editing.facts.modalities
    side = 2 * editing.facts.size_multiple
    spec = dataclasses.replace(editing.spec(n=2, strength=strength), num_frames=5, reference_image=None,
                               reference_video=a_video(5, side))
    frames = _staged(editing, spec)
    assert frames.shape == (2, 5, side, side, 3) and spec.run_steps == steps_run
    assert torch.equal(frames, editing.reference(spec))
    still = dataclasses.replace(spec, reference_video=_still(5, side))
    assert not torch.equal(frames, _staged(editing, still)), "the edit starts from the video's own frames"


def _still(frames: int, side: int) -> bytes:
    from deployments.wire import media

    return media.mp4_bytes(torch.full((frames, side, side, 3), 0.5), 4)


def test_a_guided_video_edit_is_the_video_to_video_pipeline_within_one_level():
    editing = _LOADED.get("wan2.1") or Editing("wan2.1")
    side = 2 * editing.facts.size_multiple
    spec = dataclasses.replace(editing.spec(guidance=editing.facts.default_guidance), num_frames=5,
                               reference_image=None, reference_video=a_video(5, side))
    frames, reference = _staged(editing, spec), editing.reference(spec)
    levels = ((frames * 255).round() - (reference * 255).round()).abs().max().item()
    assert spec.guidance_scale > 1 and levels <= 1, levels


def test_a_video_edit_asking_more_frames_than_the_mp4_holds_is_refused_by_name():
    from deployments.wire.media import VideoDecodeError

    editing = _LOADED.get("wan2.1") or Editing("wan2.1")
    side = 2 * editing.facts.size_multiple
    spec = dataclasses.replace(editing.spec(), num_frames=9, reference_image=None, reference_video=a_video(5, side))
    with pytest.raises(VideoDecodeError, match="has 5 frames, 9 asked for"):
        families.condition(editing.pipes[DECODE], editing.facts, spec, CPU)


def test_an_uploaded_video_of_another_size_is_edited_at_the_asked_size_from_the_frames_ffmpeg_scaled():
    """POST /v1/videos/edits with a clip of its own size: the decoder stage decodes it scaled to the edit's size
    (as the ingress counted its frames), and the edit is the pipeline's on those frames."""
    editing = _LOADED.get("wan2.1") or Editing("wan2.1")
    side = 2 * editing.facts.size_multiple
    clip = a_video(7, side + 8)  # 40x40 native, 7 frames: the edit takes 5 at 32x32
    spec = dataclasses.replace(editing.spec(n=1, strength=0.6), num_frames=5, reference_image=None,
                               reference_video=clip)
    frames = _staged(editing, spec)
    assert frames.shape == (1, 5, side, side, 3)
    assert torch.equal(frames, editing.reference(spec))
