"""The OpenAPI 3 document of the server (`/openapi.json`) and its Swagger UI page (`/docs`).

Hand-written, so the schema states TGI's field rules (nullable, absent-when-empty) exactly.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from tgis import __version__
from tgis.server.openapi_schemas import OPENAI_SCHEMAS, TGI_SCHEMAS, ref

_JSON = "application/json"
_SSE = "text/event-stream"
TGI_TAG = "Text Generation Inference"
OPENAI_TAG = "OpenAI"

_ERRORS = {
    "401": ("Missing or wrong API key (when the server has one)", "authentication"),
    "422": ("Input validation error", "validation"),
    "424": ("Generation error", "generation"),
    "429": ("Model is overloaded", "overloaded"),
    "500": ("Incomplete generation or internal error", "internal"),
    "503": ("Server is shutting down", "unavailable"),
}


def _content(schema: dict[str, Any], media: str = _JSON) -> dict[str, Any]:
    return {media: {"schema": schema}}


def _errors(openai: bool = False) -> dict[str, Any]:
    schema = ref("OpenAIError") if openai else ref("ErrorResponse")
    return {
        code: {"description": text, "content": _content(schema)}
        for code, (text, _) in _ERRORS.items()
    }


def _post(
    summary: str, request: str, ok: dict[str, Any], tag: str, openai: bool = False
) -> dict[str, Any]:
    return {
        "post": {
            "tags": [tag],
            "summary": summary,
            "requestBody": {"required": True, "content": _content(ref(request))},
            "responses": {"200": {"description": "OK", "content": ok}, **_errors(openai)},
            "security": [{"bearer": []}, {}],
        }
    }


def _get(summary: str, ok: dict[str, Any], tag: str, **extra: Any) -> dict[str, Any]:
    responses = {"200": {"description": "OK", "content": ok}, **extra}
    return {"get": {"tags": [tag], "summary": summary, "responses": responses}}


def _paths() -> dict[str, Any]:
    gen, stream = ref("GenerateResponse"), ref("StreamResponse")
    unhealthy = {"503": {"description": "Unhealthy", "content": _content(ref("ErrorResponse"))}}
    return {
        "/": _post(
            "Generate; `stream` chooses JSON (a one-element list) or server-sent events",
            "CompatGenerateRequest",
            {**_content({"type": "array", "items": gen}), **_content(stream, _SSE)},
            TGI_TAG,
        )
        | _get("Health check (as /health)", {}, TGI_TAG, **unhealthy),
        "/generate": _post("Generate text", "GenerateRequest", _content(gen), TGI_TAG),
        "/generate_stream": _post(
            "Generate a stream of tokens (server-sent events, one StreamResponse each)",
            "GenerateRequest",
            _content(stream, _SSE),
            TGI_TAG,
        ),
        "/tokenize": _post(
            "Tokenize inputs", "GenerateRequest", _content(ref("TokenizeResponse")), TGI_TAG
        ),
        "/info": _get("Served model info", _content(ref("Info")), TGI_TAG),
        "/health": _get("Health check", {}, TGI_TAG, **unhealthy),
        "/metrics": _get("Prometheus metrics", _content({"type": "string"}, "text/plain"), TGI_TAG),
        "/v1/completions": _post(
            "OpenAI completions",
            "CompletionRequest",
            {**_content(ref("Completion")), **_content(ref("Completion"), _SSE)},
            OPENAI_TAG,
            openai=True,
        ),
        "/v1/chat/completions": _post(
            "OpenAI chat completions (the model's chat template)",
            "ChatRequest",
            {**_content(ref("ChatCompletion")), **_content(ref("ChatCompletionChunk"), _SSE)},
            OPENAI_TAG,
            openai=True,
        ),
        "/v1/models": _get("The served model", _content(ref("ModelList")), OPENAI_TAG),
        "/openapi.json": _get("This document", _content({"type": "object"}), "Documentation"),
        "/docs": _get("Swagger UI", _content({"type": "string"}, "text/html"), "Documentation"),
    }


def openapi_document() -> dict[str, Any]:
    """The whole OpenAPI document."""
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "tgis: Text Generation Inference",
            "version": __version__,
            "license": {"name": "Apache 2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
        },
        "tags": [
            {"name": TGI_TAG, "description": "Hugging Face Text Generation Inference API"},
            {"name": OPENAI_TAG, "description": "OpenAI-compatible API"},
        ],
        "paths": _paths(),
        "components": {
            "schemas": {**TGI_SCHEMAS, **OPENAI_SCHEMAS},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


_DOCS_HTML = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>tgis API</title>
  <link rel="stylesheet" href="https://unpkg.com/swagger-ui-dist@5/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui">
    <noscript>The interactive page needs JavaScript; the schema is at
    <a href="openapi.json">openapi.json</a>.</noscript>
  </div>
  <script src="https://unpkg.com/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
  <script>
    window.onload = () => {
      window.ui = SwaggerUIBundle({ url: "openapi.json", dom_id: "#swagger-ui" });
    };
  </script>
</body>
</html>
"""


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json."""
    return JSONResponse(openapi_document())


async def docs(request: Request) -> Response:
    """GET /docs: Swagger UI (its assets come from a CDN) over /openapi.json."""
    return HTMLResponse(_DOCS_HTML)
