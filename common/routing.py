"""The HTTP plumbing the API contract is built from: JSON answers, bodies read and validated in
one pass, errors in one shape.

``common.api`` uses these to define the routes; a stage never needs them directly.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from common.limits import APIError, error_response
from common.schemas import ErrorResponse
from common.settings import Settings

log = logging.getLogger("embedserve")

JSON = "application/json"
_Body = TypeVar("_Body", bound=BaseModel)


class NumpyJSONResponse(JSONResponse):
    """JSON by orjson, which writes the numpy vectors as they are (``OPT_SERIALIZE_NUMPY``): a
    (n, 384) float32 array goes out row by row, with no list of Python floats made first."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


# --8<-- [start:read_body]
async def read_body(request: Request, model: type[_Body]) -> _Body:
    """Parse and validate a JSON body in one pass, in pydantic-core.

    FastAPI's own body path decodes with the stdlib ``json``, which lets a lone surrogate such
    as ``"\\ud800"`` through to the tokenizer (a 500 there); pydantic-core, validating the bytes,
    refuses it as invalid JSON (a 422). The routes still describe their bodies in the OpenAPI
    schema (``body_doc``).
    """
    try:
        raw = await request.body()
    except ClientDisconnect:  # the client left mid-body: nobody reads the answer, but it is no 500
        raise APIError(499, "client closed the connection before sending the whole body") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        message, param = describe_validation_error(exc.errors(include_url=False, include_input=False))
        raise APIError(422, message, param=param) from None


# --8<-- [end:read_body]


def body_doc(model: type[BaseModel], field: str, settings: Settings) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` for a route that parses its body itself (``read_body``).

    The text field also states this server's limits (MAX_ITEMS, MAX_CHARS), which
    ``validate_texts`` checks with its own messages, so a schema-driven client or fuzzer
    knows which inputs are valid.
    """
    schema = model.model_json_schema()
    text = {"type": "string", "minLength": 1, "maxLength": settings.max_chars}
    many = {"type": "array", "items": text, "minItems": 1, "maxItems": settings.max_items}
    schema["properties"][field]["anyOf"] = [text, many]
    return {"requestBody": {"required": True, "content": {JSON: {"schema": schema}}}}


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in {
        400: "Bad header (X-Request-Timeout)",
        408: "Body not received within BODY_TIMEOUT_S",
        413: "Body larger than MAX_BODY_BYTES",
        415: "Compressed body (Content-Encoding other than identity)",
        422: "Invalid body: the message names the field (and the index)",
        503: "Not ready, or overloaded (later stages)",
        504: "Deadline passed (later stages)",
    }.items()
}


def describe_validation_error(errors: Any) -> tuple[str, str | None]:
    """One clear sentence, and the field it is about, for pydantic's errors.

    Works for both ``read_body`` (locations start at the field) and FastAPI's own
    validation (locations start with ``"body"``). A union ``str | list[str]`` reports one
    error per branch; the list branch names the offending item, so it wins.
    """
    errors = list(errors)
    if not errors:
        return "invalid request", None
    first = errors[0]
    for err in errors:
        where = tuple(err.get("loc", ()))
        if "list[str]" in where and isinstance(where[-1], int):
            first = err
            break
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = str(first.get("msg", "")).removeprefix("Invalid JSON: ")
        return f"request body is not valid JSON ({detail})", None
    loc = [p for p in first.get("loc", ()) if p not in ("body", "str", "list[str]")]
    if kind in ("model_type", "model_attributes_type", "dict_type") or not loc:
        return "request body must be a JSON object", None
    param = str(loc[0])
    for p in loc[1:]:
        param += f"[{p}]" if isinstance(p, int) else f".{p}"
    if kind == "missing":
        return f"`{param}` is required", param
    if kind == "extra_forbidden":
        return f"unknown field `{param}`", param
    if param in ("inputs", "input") and kind in ("string_type", "list_type"):
        return f"`{param}` must be a string or a list of strings", param
    if kind == "string_type":
        return f"`{param}` must be a string", param
    return f"`{param}`: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Every error any route or middleware raises answers in the one shape (``error_response``)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    # Routes that let FastAPI parse a body (a later stage's extra routes) get the same shape.
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = describe_validation_error(exc.errors())
        return error_response(APIError(422, message, param=param))

    # 404 unknown route, 405 wrong method, 413/408 from BodyGuard on a chunked or slow body.
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))
