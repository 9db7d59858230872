"""GET /v1/models states the largest request the service admits: configured limits ∩ every replica's room."""
from __future__ import annotations

import dataclasses

from fastapi.testclient import TestClient
from ray.exceptions import ActorUnavailableError

from deployments.api.routes import build_api
from deployments.capacity.admission import LimitSource, StageAdmission, model_limits, nearest_admitted
from deployments.capacity.replica_report import ReplicaResidency
from deployments.capacity.request_limits import Limits
from deployments.models.activation_features import Regime
from deployments.models.families import read_family_traits
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.planner.activation_model import ActivationModel
from tests.deployments.fakes import FakeBoard, FakeStages, fake_config
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan

WAN = read_family_traits(ensure_tiny_wan())  # size multiple 16, temporal factor 4
LIMITS = Limits(max_width=512, max_height=512, max_n=16, max_frames=81, default_size="32x32", default_steps=2)
ROOMY = 10**12  # a share no request of these tests comes near


def _model(names, coefficients) -> ActivationModel:
    return ActivationModel(tuple(names), tuple(float(c) for c in coefficients), 4)


def _decode(room: int) -> StageAdmission:
    """The tiny Wan decoder's calibrated shape (367 B per output pixel per image, 843 + 48.5 x frames per
    video pixel) with ``room`` beside its weights."""
    return StageAdmission(PipelineStage.DECODE, room, (
        (Regime.IMAGE, _model(("n x pixels", "1"), (367.0, 7415))),
        (Regime.VIDEO, _model(("n x pixels", "n x pixels x frames"), (843.0, 48.5)))))


def _admissions(decode_room: int, denoise_room: int = ROOMY) -> tuple[StageAdmission, ...]:
    encode = _model(("1", "n"), (14_560_000, 65_536))
    denoise = _model(("n", "n x tokens"), (331_700, 1450))
    return (StageAdmission(PipelineStage.ENCODE, ROOMY, ((Regime.IMAGE, encode), (Regime.VIDEO, encode))),
            StageAdmission(PipelineStage.DENOISE, denoise_room, ((Regime.IMAGE, denoise), (Regime.VIDEO, denoise))),
            _decode(decode_room))


def _spec(width, height, frames=1, n=1) -> GenerationSpec:
    return GenerationSpec("t", "p", None, height, width, frames, 2, WAN.default_guidance, 0, n)


def _admitted(admissions, spec) -> bool:
    return all(a.admits(WAN, spec) for a in admissions)


def test_until_every_stage_has_reported_the_configured_limits_are_stated():
    for reported in ((), _admissions(1)[:2]):  # nothing yet; encode and denoise but no decoder
        limits = model_limits(WAN, LIMITS, reported)
        assert limits.source is LimitSource.CONFIGURED
        assert (limits.width, limits.height, limits.frames, limits.n) == (512, 512, 81, 16)
        assert limits.at_size == "32x32" and set(limits.limited_by.values()) == {"configured"}


def test_each_measured_limit_is_admitted_and_the_next_step_up_is_refused():
    admissions = _admissions(decode_room=367 * 96 * 96 + 7415)  # the decoder holds 96x96 exactly
    limits = model_limits(WAN, LIMITS, admissions)
    assert limits.source is LimitSource.MEASURED
    assert (limits.width, limits.height, limits.at_size) == (96, 96, "32x32")
    assert limits.limited_by == {"width": "decode", "height": "decode", "frames": "decode", "n": "decode"}
    assert _admitted(admissions, _spec(96, 96)) and not _admitted(admissions, _spec(112, 112))
    assert limits.frames > 1 and (limits.frames - 1) % 4 == 0
    assert _admitted(admissions, _spec(32, 32, limits.frames))
    assert not _admitted(admissions, _spec(32, 32, limits.frames + 4))
    assert 1 < limits.n < 16
    assert _admitted(admissions, _spec(32, 32, n=limits.n)) and not _admitted(admissions, _spec(32, 32, n=limits.n + 1))
    # Every smaller size is admitted too, at any aspect within it.
    assert all(_admitted(admissions, _spec(w, h)) for w in range(16, 97, 16) for h in range(16, 97, 16))


def test_the_smallest_room_of_any_replica_of_a_stage_binds():
    roomy, tight = _admissions(decode_room=ROOMY), _decode(367 * 48 * 48 + 7415)
    limits = model_limits(WAN, LIMITS, (*roomy, tight))  # two decoder replicas: one on a small share
    assert (limits.width, limits.height) == (48, 48)
    alone = model_limits(WAN, LIMITS, roomy)
    assert (alone.width, alone.height, alone.n, alone.frames) == (512, 512, 16, 81)
    assert set(alone.limited_by.values()) == {"configured"}


def test_sizes_follow_the_default_sizes_aspect_and_frames_and_n_are_stated_at_the_default_size():
    wide = LIMITS.model_copy(update={"max_width": 832, "max_height": 832, "default_size": "832x480"})
    admissions = _admissions(decode_room=367 * 416 * 240 + 7415)
    limits = model_limits(WAN, wide, admissions)
    assert (limits.width, limits.height) == (416, 240), "832x480's aspect, the largest the decoder holds"
    assert limits.at_size == "416x240", "the default 832x480 is not admitted: frames and n are stated at the limit"
    assert limits.n == 1 and limits.frames == 1, "at the largest image size there is no room for more"


def test_an_image_only_family_states_one_frame():
    flux = read_family_traits(ensure_tiny_flux())
    limits = model_limits(flux, LIMITS, _admissions(ROOMY))
    assert limits.frames == 1 and limits.limited_by["frames"] == "family"


def test_nothing_admitted_is_stated_as_zeros():
    limits = model_limits(WAN, LIMITS, _admissions(decode_room=1000))
    assert (limits.width, limits.height, limits.frames, limits.n, limits.at_size) == (0, 0, 0, 0, None)


def test_a_refusal_names_the_largest_request_like_it_along_each_axis():
    decode = _decode(367 * 96 * 96 + 7415)
    many = _spec(32, 32, n=40)
    nearest = nearest_admitted(decode, WAN, many)
    assert nearest.param(many) == "n" and nearest.n == 9 and nearest.size is None  # 40 fit at no size
    video = _spec(32, 32, frames=81)
    nearest = nearest_admitted(decode, WAN, video)
    assert nearest.param(video) == "num_frames" and decode.admits(WAN, dataclasses.replace(video, num_frames=nearest.frames))
    assert not decode.admits(WAN, dataclasses.replace(video, num_frames=nearest.frames + 4))
    assert f"{nearest.frames} frames at this size" in nearest.describe(video)
    big = _spec(512, 256)
    nearest = nearest_admitted(decode, WAN, big)
    # 2:1, heights rounded down to a multiple of 16: 144 x 72 -> 144 x 64 (9216 pixels, as 96x96); 160 x 80 is not.
    assert nearest.param(big) == "size" and nearest.size == (144, 64) and "size 144x64" in nearest.describe(big)


def _report(admission: StageAdmission) -> ReplicaResidency:
    stage = admission.stage.value
    return ReplicaResidency(f"fake-{stage}", stage, "cpu", "memory", (), 0, 0, 0, {}, admission=admission)


def test_the_models_route_states_measured_limits_and_the_schema_explains_them():
    board = FakeBoard(tuple(_report(a) for a in _admissions(decode_room=367 * 48 * 48 + 7415)))
    config = dataclasses.replace(fake_config(token=None), limits=LIMITS)
    client = TestClient(build_api(config, FakeStages(), board))
    (model,) = client.get("/v1/models").json()["data"]
    assert model["limits"]["source"] == "measured" and (model["limits"]["width"], model["limits"]["height"]) == (48, 48)
    assert model["configured_limits"]["max_width"] == 512 and model["object"] == "model"
    assert {"replica", "activation_room_bytes"} <= set(client.get("/v1/residency").json()["replicas"][0])
    schema = client.get("/openapi.json").json()["components"]["schemas"]["ModelLimits"]["properties"]
    assert "default_size's aspect ratio" in schema["width"]["description"]
    assert "'measured'" in schema["source"]["description"]
    board.reports = board.reports[:2]  # the decoder is gone (replaced): configured until it reports again
    (model,) = client.get("/v1/models").json()["data"]
    assert model["limits"]["source"] == "configured" and model["limits"]["width"] == 512


class _RestartingBoard(FakeBoard):
    """The board while Ray restarts its actor: every call fails as a dead actor's does."""

    async def residency(self):
        raise ActorUnavailableError("the residency board is restarting", b"\0" * 16)

    async def pending_replicas(self):
        raise ActorUnavailableError("the residency board is restarting", b"\0" * 16)


def test_while_the_board_restarts_models_state_the_configured_limits_and_residency_is_a_503(caplog):
    config = dataclasses.replace(fake_config(token=None), limits=LIMITS)
    client = TestClient(build_api(config, FakeStages(), _RestartingBoard()), raise_server_exceptions=False)
    models = client.get("/v1/models")
    assert models.status_code == 200
    (model,) = models.json()["data"]
    assert model["limits"]["source"] == "configured" and model["limits"]["width"] == 512
    residency = client.get("/v1/residency")
    assert residency.status_code == 503 and residency.headers["retry-after"] == "1"
    assert residency.json()["error"]["code"] == "board_unavailable"
    assert any("residency board is unreachable" in r.getMessage() for r in caplog.records)


def test_an_in_context_edit_family_states_its_largest_edit_beside_its_largest_generation():
    # A Denoiser room that holds a 512x512 generation (1024 tokens) but not beside an edit's 4096 image tokens.
    from deployments.api.model_list import model_card, square_image
    from zoo.tiny import ensure_tiny_flux_kontext
    from zoo.tiny_families import ensure_tiny_qwen_image_edit

    kontext = read_family_traits(ensure_tiny_flux_kontext())
    room = 331_700 + 1450 * (32 * 32 + 1024)  # the Denoiser's model above: 2048 tokens fit, n=1
    card = model_card("kontext", kontext, LIMITS, _admissions(ROOMY, denoise_room=room))
    assert (card.limits.width, card.limits.height) == (512, 512) and card.limits.limited_by["width"] == "configured"
    assert card.edit_limits is not None and card.edit_limits.limited_by["width"] == "denoise"
    assert card.edit_limits.width == 0, "4096 image tokens alone exceed the room: no edit is admitted"
    edits = _admissions(ROOMY, denoise_room=room + 1450 * 4096)
    card = model_card("kontext", kontext, LIMITS, edits)
    assert (card.edit_limits.width, card.edit_limits.height) == (512, 512)
    spec = dataclasses.replace(_spec(512, 512), reference_image=square_image())
    assert all(a.admits(kontext, spec) for a in edits) and not all(
        a.admits(kontext, dataclasses.replace(spec, n=2)) for a in edits)
    assert card.edit_limits.n == 1 < card.limits.n
    # An edit-only family's limits count its image already (every request has one); it states no edit_limits.
    qwen_edit = read_family_traits(ensure_tiny_qwen_image_edit())
    card = model_card("qwen-edit", qwen_edit, LIMITS, _admissions(ROOMY, denoise_room=room))
    assert card.edit_limits is None and card.limits.width == 0 and card.limits.limited_by["width"] == "denoise"
