"""``POST /v1/images/variations``: DALL·E 2's variations of an image, without a prompt. Not served, and said so.

DALL·E 2 makes a variation from an image's own embedding; none of the families served here has an
image-variation pipeline (diffusers' are unCLIP's and Kandinsky's priors). The route answers the
official client's ``images.create_variation`` with a 400 naming ``model`` that points to what is served:
an edit of the image with a prompt (``POST /v1/images/edits``, its ``strength`` how far it may go),
rather than the bare 404 of a path unknown here. The body is not read. Run by the ingress replica.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from deployments.api import errors
from deployments.api.service import Service
from deployments.capacity.request_limits import FieldError

VARIATIONS = "/v1/images/variations"

router = APIRouter()


@router.post(VARIATIONS)
async def variations(request: Request):
    service: Service = request.app.state.service
    return errors.field_error(FieldError(
        "model", f"image variations (DALL·E 2's) are not served: the {service.config.facts.family.value} model "
                 "family has no image-variation pipeline; send the image with a prompt to POST /v1/images/edits "
                 "('strength' sets how far the edit may go from it)"))
