"""The HTTP edge of the ingress: the FastAPI app and its OpenAPI document, OpenAI-shaped errors (`error_body`: an HTTP
error's body, and a stream's error event), API keys and the request-body limit. Everything else here runs before a
request body is parsed; dcpserve/deployments/api/ingress.py binds the routes.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dcpserve.deployments.api import openapi
from dcpserve.deployments.messages import ANONYMOUS, ApiError

api = FastAPI(title="dcpserve", version="0.1", docs_url=None, redoc_url=None,
              description="OpenAI-compatible completions and chat completions over TP x DCP replicas with KV-aware "
                          "admission. /v1 routes need `Authorization: Bearer <key>` when the app has API keys.")


def _openapi() -> dict[str, Any]:
    """FastAPI's document plus the request-body schemas the routes declare through openapi_extra."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi.OPENAPI_SCHEMAS)
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = _openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema


# OpenAI's error type of each HTTP status the app answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods (404 / 405) answer in OpenAI's error shape too."""
    return JSONResponse(error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


def error_response(err: ApiError) -> JSONResponse:
    """An ApiError as its OpenAI-shaped body, with its status and Retry-After."""
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=headers)


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """Every problem pydantic found, as one message, and the first problem's parameter."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    def describe(e: Any) -> str:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        if e["type"] == "extra_forbidden":
            return (f"{where}: unknown or unsupported field; it would change what is generated and this server does "
                    f"not implement it (docs/operations.md lists every field)")
        return f"{where}: {e['msg']}"

    messages = "; ".join(describe(e) for e in err.errors())
    return messages, param


def authorize(request: Request, api_keys: list[tuple[str, bytes]]) -> str:
    """The request's tenant: the name of the API key it carries, ANONYMOUS when the app has none; 401 unless it
    carries one of them. Every key is compared in constant time, all of them every time, and the answer never says
    which part was wrong."""
    if not api_keys:
        return ANONYMOUS
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    sent = token.strip().encode() if scheme.lower() == "bearer" else b""
    tenant = None
    for name, key in api_keys:
        if hmac.compare_digest(sent, key):
            tenant = name
    if tenant is None:
        raise ApiError(401, "invalid or missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
    return tenant


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length, then while reading)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared)} bytes; max_request_body_bytes={limit}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than max_request_body_bytes={limit}",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
