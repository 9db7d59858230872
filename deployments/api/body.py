"""Request bodies parsed with bounds checked *before* the parser can hit them.

Python's json module recurses once per nesting level (a body nested a few thousand levels deep
raises ``RecursionError``) and refuses integers over 4,300 digits with a bare ``ValueError``;
both were 500s. Here the depth is counted on the raw text first, numbers longer than
:data:`MAX_NUMBER_CHARS` are refused by the parser's own hooks, and every failure is a
:class:`BodyError` that the ingress answers with a 4xx naming the body.
"""
from __future__ import annotations

import json
import re

from deployments.capacity.request_limits import FieldError

# Not pydantic_core.from_json: its depth limit is fixed at 200, any number length passes, lone surrogates fail unnamed.
# Our bodies are flat objects (depth 1); 32 leaves room for clients that wrap extras, far below
# the ~1,000 levels where CPython's json recursion fails.
MAX_DEPTH = 32
# The longest number a field accepts is a 63-bit seed (19 digits); 100 allows any float spelling.
MAX_NUMBER_CHARS = 100
# A prompt of 2,000 characters is under 10 KB even as \\u escapes; 1 MiB bounds the parse cost.
MAX_BODY_BYTES = 1024 * 1024

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


class BodyError(ValueError):
    """The body is not a JSON object within the bounds; ``status`` is 400 or 413."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_json"):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


def _depth(text: str) -> int:
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRING.sub('""', text)):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _number(kind: type):
    def parse(literal: str):
        if len(literal) > MAX_NUMBER_CHARS:
            raise BodyError(f"a number of {len(literal)} characters exceeds the limit of {MAX_NUMBER_CHARS}")
        return kind(literal)

    return parse


def _constant(name: str):
    raise BodyError(f"{name} is not valid JSON")


def parse_object(raw: bytes) -> dict:
    """The body as a dict, or :class:`BodyError` (never RecursionError, ValueError or UnicodeError)."""
    if len(raw) > MAX_BODY_BYTES:
        raise BodyError(f"body of {len(raw)} B exceeds the limit of {MAX_BODY_BYTES} B", 413, "body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    if (depth := _depth(text)) > MAX_DEPTH:
        raise BodyError(f"JSON nested {depth} levels deep exceeds the limit of {MAX_DEPTH}")
    try:
        body = json.loads(text, parse_int=_number(int), parse_float=_number(float), parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise BodyError(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BodyError("body must be a JSON object")
    return body


# The official client posts multipart/form-data when a request carries a file; curl users post JSON.
FORM_TYPES = ("application/json", "multipart/form-data")
MAX_FORM_FIELDS = 32


async def read_fields(request, file_fields: tuple[str, ...], max_bytes: int, max_file_bytes: int,
                      max_files: int = 1, list_fields: tuple[str, ...] = ()) -> dict:
    """A create body's fields as a dict: a JSON object (:func:`parse_object`), or multipart/form-data with
    at most ``max_files`` files, each in one of ``file_fields`` (its bytes, or in one of ``list_fields`` the list of
    every file sent in it; every other value a string). The whole body is bounded by ``max_bytes``, plus
    ``max_file_bytes`` for a form. Anything else is a :class:`FieldError` naming it:
    415 for another content type, 413 for a body over the bound, 400 for a malformed one."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await request.body()
    limit = max_bytes + (max_file_bytes if content_type == "multipart/form-data" else 0)
    if len(raw) > limit:
        raise FieldError("body", f"{len(raw)} B exceeds the limit of {limit} B", 413, "body_too_large")
    if content_type == "application/json":
        try:
            return parse_object(raw)
        except BodyError as exc:
            raise FieldError("body", exc.message, exc.status, exc.code) from None
    if content_type != "multipart/form-data":
        raise FieldError("content-type", f"Content-Type {content_type or '(none)'!r} is not accepted here; send "
                                         f"{' or '.join(FORM_TYPES)}", 415, "unsupported_media_type")
    try:
        form = await request.form(max_files=max_files, max_fields=MAX_FORM_FIELDS, max_part_size=limit)
    except Exception as exc:  # starlette's MultiPartException and malformed boundaries
        raise FieldError("body", f"body is not valid multipart/form-data: {exc}", code="invalid_form") from None
    fields = {}
    for name, value in form.multi_items():
        if not isinstance(value, str):
            if name not in file_fields:
                raise FieldError(name, f"file uploads are taken only as {' or '.join(file_fields)}")
            value = await value.read()  # within the body limit already read above
            if name in list_fields:  # a list of files (the client's ``image[]``): every one, in order
                fields.setdefault(name, []).append(value)
                continue
            if name in fields:  # never the last of several silently
                raise FieldError(name, "takes one file per request")
        fields[name] = value
    return fields
