"""Every failure the HTTP layer reports, as (status, message, error_type), and its two JSON shapes.

TGI's messages and error types: validation 422, overloaded 429, generation 424, incomplete
generation 500. Anything unexpected is a 500 "internal" whose details go to the log only:
clients never see a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

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


def error_response(error: ApiError, openai: bool = False) -> JSONResponse:
    """The JSON response of an error, in TGI's shape or OpenAI's."""
    body = openai_body(error) if openai else tgi_body(error)
    return JSONResponse(body, status_code=error.status)
