"""Every failure the HTTP layer reports, as (status, message, error_type), and its JSON shapes
(TGI's, OpenAI's, Anthropic's).

TGI's messages and error types: validation 422, overloaded 429, generation 424, incomplete
generation 500. Anything unexpected is a 500 "internal" whose details go to the log only:
clients never see a traceback.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from starlette.responses import JSONResponse

from tgis.errors import GenerationError, InputValidationError, OverloadedError

logger = logging.getLogger("tgis.server")

VALIDATION_PREFIX = "Input validation error: "


class ApiError(Exception):
    """An error response: HTTP status, message for the client, TGI's `error_type`."""

    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


def invalid(message: str) -> ApiError:
    """A 422 validation error with TGI's message prefix."""
    if not message.startswith(VALIDATION_PREFIX):
        message = VALIDATION_PREFIX + message
    return ApiError(422, message, "validation")


# Shared instances build responses only; code that raises makes a fresh ApiError.
UNAUTHORIZED = ApiError(401, "Unauthorized", "authentication")
SHUTTING_DOWN = ApiError(503, "Server is shutting down", "unavailable")
INTERNAL = ApiError(500, "Internal server error", "internal")


def classify(exc: BaseException) -> ApiError:
    """The response for an exception raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InputValidationError):
        return invalid(str(exc))
    if isinstance(exc, OverloadedError):
        return ApiError(429, "Model is overloaded", "overloaded")
    if isinstance(exc, GenerationError):
        return ApiError(424, f"Request failed during generation: {exc}", "generation")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return INTERNAL


Shape = Literal["tgi", "openai", "anthropic"]

# Anthropic's error type of each status; its clients expect 400 where TGI says 422, and 529
# (overloaded) where the queue is full.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_ANTHROPIC_STATUS = {422: 400, 429: 529}


def shape_of(path: str) -> Shape:
    """The error shape of a route: Anthropic's on /v1/messages, OpenAI's on the rest of /v1/,
    TGI's elsewhere."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "openai" if path.startswith("/v1/") else "tgi"


def tgi_body(error: ApiError) -> dict[str, Any]:
    """TGI's error JSON."""
    return {"error": error.message, "error_type": error.error_type}


def openai_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error JSON (the openai client reads `error.message`)."""
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": None,
            "code": error.status,
        }
    }


def anthropic_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error JSON (the anthropic client reads `error.type` and `error.message`)."""
    status = error_status(error, "anthropic")
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_body(error: ApiError, shape: Shape) -> dict[str, Any]:
    if shape == "anthropic":
        return anthropic_body(error)
    return openai_body(error) if shape == "openai" else tgi_body(error)


def error_event(error: ApiError, shape: Shape) -> str:
    """A server-sent event that reports an error after a stream began, as each family writes
    it: Anthropic's `event: error`, OpenAI's `data: `, TGI's `data:`."""
    data = json.dumps(error_body(error, shape))
    if shape == "anthropic":
        return f"event: error\ndata: {data}\n\n"
    return f"data: {data}\n\n" if shape == "openai" else f"data:{data}\n\n"


def error_status(error: ApiError, shape: Shape) -> int:
    """The HTTP status of an error in a route family's terms."""
    return (
        _ANTHROPIC_STATUS.get(error.status, error.status) if shape == "anthropic" else error.status
    )


def error_response(error: ApiError, shape: Shape = "tgi") -> JSONResponse:
    """The JSON response of an error, in TGI's, OpenAI's or Anthropic's shape."""
    return JSONResponse(error_body(error, shape), status_code=error_status(error, shape))
