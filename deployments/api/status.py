"""Whether the service answers: ``GET /health``, ``GET /v1/models`` and ``GET /v1/models/{id}``.

One router, mounted by :func:`deployments.api.routes.build_api` in the ingress replica's process.
Both follow ``app.state.serving`` (a :class:`deployments.api.seams.ServingCheck`, or None when
the app runs without one): a stage without a running replica makes /health a 503 and marks every
model card ``serving: false``.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from deployments.api import errors
from deployments.api.model_list import ModelCard, ModelList
from deployments.api.schemas import check_model
from deployments.api.serving import not_serving
from deployments.capacity.request_limits import FieldError

router = APIRouter()


async def _serving_state(request: Request):
    serving = request.app.state.serving
    return await serving.confirm() if serving is not None else None


@router.get("/health")
async def health(request: Request):
    """200 while every stage deployment has a running replica; else 503 naming the stage and
    Serve's reason (a readiness probe's route: the ingress itself answers either way)."""
    config = request.app.state.service.config
    state = await _serving_state(request)
    if state is not None and not state.serving:
        return not_serving(state, config.retry_after_s)
    return {"status": "ok", "model": config.model_id}


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    listed = await request.app.state.service.models()
    state = await _serving_state(request)
    if state is None or state.serving:
        return listed
    down = {"serving": False, "not_serving": state.describe()}
    return listed.model_copy(update={"data": [card.model_copy(update=down) for card in listed.data]})


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def model(request: Request, model_id: str):
    """OpenAI's retrieve: the served model's card (an id with a '/' too), or 404 ``model_not_found``."""
    try:
        check_model(model_id, request.app.state.service.config.model_id)
    except FieldError as exc:
        return errors.field_error(exc)
    return (await models(request)).data[0]
