"""The OpenAPI 3 document of the server (`/openapi.json`) and its Swagger UI page (`/docs`).

OpenAPI 3.1: the schemas are each API's (its `openapi` module: the request ones built from the
server's limits, which `tgis.server.http.contract` holds every request body to); the paths are
written here. Swagger UI's own files come from the installed
openapi-ui-bundles package (`/docs/assets/...`), so the page needs no network beyond this server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from openapi_ui_bundles import __version__ as _BUNDLE_VERSION
from openapi_ui_bundles.swagger_ui import static_path as _SWAGGER_UI_DIR
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response

from tgis import __version__
from tgis.server.http.openapi_schemas import ref
from tgis.server.http.playground import ASSETS as PLAYGROUND_ASSETS
from tgis.server.http.state import get_state

if TYPE_CHECKING:
    from tgis.server.http.contract import RequestContract

_JSON = "application/json"
_SSE = "text/event-stream"
TGI_TAG = "Text Generation Inference"
OPENAI_TAG = "OpenAI"
ANTHROPIC_TAG = "Anthropic"

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


def _events(schema: dict[str, Any], error: str, done: bool = False) -> dict[str, Any]:
    """Server-sent events whose `data` is `schema` as JSON (or `error`'s, for a failure in
    the stream; OpenAI's streams end with `data: [DONE]`). Before OpenAPI 3.2 a stream's
    schema describes one event."""
    data: dict[str, Any] = {
        "type": "string",
        "contentMediaType": _JSON,
        "contentSchema": {"anyOf": [schema, ref(error)]},
    }
    if done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {_SSE: {"schema": event}}


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


def _paths(playground: bool) -> dict[str, Any]:
    gen, stream = ref("GenerateResponse"), ref("StreamResponse")
    unhealthy = {"503": {"description": "Unhealthy", "content": _content(ref("ErrorResponse"))}}
    paths: dict[str, Any] = {
        "/": _post(
            "Generate; `stream` chooses JSON (a one-element list) or server-sent events",
            "CompatGenerateRequest",
            {**_content({"type": "array", "items": gen}), **_events(stream, "ErrorResponse")},
            TGI_TAG,
        )
        | _get(
            "Health check (as /health); a browser (Accept: text/html) gets the playground "
            "instead, unless --no-playground",
            {},
            TGI_TAG,
            **unhealthy,
        ),
        "/generate": _post("Generate text", "GenerateRequest", _content(gen), TGI_TAG),
        "/generate_stream": _post(
            "Generate a stream of tokens (server-sent events, one StreamResponse each)",
            "GenerateStreamRequest",
            _events(stream, "ErrorResponse"),
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
            {**_content(ref("Completion")), **_events(ref("Completion"), "OpenAIError", True)},
            OPENAI_TAG,
            openai=True,
        ),
        "/v1/chat/completions": _post(
            "OpenAI chat completions (the model's chat template)",
            "ChatRequest",
            {
                **_content(ref("ChatCompletion")),
                **_events(ref("ChatCompletionChunk"), "OpenAIError", True),
            },
            OPENAI_TAG,
            openai=True,
        ),
        "/v1/responses": _responses_post(),
        "/v1/responses/{response_id}": _stored_response(),
        "/v1/messages": _messages_post(),
        "/v1/messages/count_tokens": _anthropic_post(
            "Anthropic Messages: the prompt's tokens, as /v1/messages would make it",
            "CountTokensRequest",
            _content(ref("MessageTokensCount")),
        ),
        "/v1/models": _get("The served model", _content(ref("ModelList")), OPENAI_TAG),
        "/openapi.json": _get("This document", _content({"type": "object"}), "Documentation"),
        "/docs": _get("Swagger UI", _content({"type": "string"}, "text/html"), "Documentation"),
        "/docs/assets/{name}": _asset_path(
            "Swagger UI's files (the /docs page loads them)", SWAGGER_UI_ASSETS, "Swagger UI's"
        ),
    }
    if playground:
        paths["/playground/{name}"] = _asset_path(
            "The playground's files (the page at GET / loads them)",
            PLAYGROUND_ASSETS,
            "the playground's",
        )
    return paths


_NOT_STORED = {
    "404": {
        "description": "No such stored response (unknown, or dropped: --max-stored-responses)",
        "content": _content(ref("OpenAIError")),
    }
}


def _typed_events(schema: dict[str, Any]) -> dict[str, Any]:
    """Server-sent events that name their type (`event: TYPE`), whose `data` is `schema`."""
    data = {"type": "string", "contentMediaType": _JSON, "contentSchema": schema}
    event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": data},
    }
    return {_SSE: {"schema": event}}


def _responses_post() -> dict[str, Any]:
    """POST /v1/responses: a Response, or Responses' stream of typed events."""
    path = _post(
        "OpenAI Responses (one chat turn; `previous_response_id` continues a stored one)",
        "ResponsesRequest",
        {**_content(ref("Response")), **_typed_events(ref("ResponseStreamEvent"))},
        OPENAI_TAG,
        openai=True,
    )
    path["post"]["responses"].update(_NOT_STORED)
    return path


# Anthropic's statuses: 400 for an invalid request, 529 when the queue is full.
_ANTHROPIC_ERRORS = {
    "400": "Invalid request",
    "401": "Missing or wrong API key (when the server has one)",
    "424": "Generation error",
    "500": "Incomplete generation or internal error",
    "503": "Server is shutting down",
    "529": "Model is overloaded",
}


def _anthropic_post(summary: str, request: str, ok: dict[str, Any]) -> dict[str, Any]:
    errors = {
        code: {"description": text, "content": _content(ref("AnthropicError"))}
        for code, text in _ANTHROPIC_ERRORS.items()
    }
    return {
        "post": {
            "tags": [ANTHROPIC_TAG],
            "summary": summary,
            "requestBody": {"required": True, "content": _content(ref(request))},
            "responses": {"200": {"description": "OK", "content": ok}, **errors},
            "security": [{"bearer": []}, {"x-api-key": []}, {}],
        }
    }


def _messages_post() -> dict[str, Any]:
    """POST /v1/messages: a Message, or Anthropic's stream of typed events."""
    events = _typed_events({"anyOf": [ref("MessageStreamEvent"), ref("AnthropicError")]})
    return _anthropic_post(
        "Anthropic Messages (one chat turn; `stream` chooses JSON or server-sent events)",
        "MessagesRequest",
        {**_content(ref("Message")), **events},
    )


def _stored_response() -> dict[str, Any]:
    path = _get("A stored response", _content(ref("Response")), OPENAI_TAG, **_NOT_STORED)
    path["get"]["parameters"] = [
        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    return path


def openapi_document(contract: RequestContract, playground: bool = False) -> dict[str, Any]:
    """The whole OpenAPI document of a server, whose request schemas are `contract`'s;
    `playground`: the server serves the playground's files."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tgis: Text Generation Inference",
            "version": __version__,
            "license": {"name": "Apache 2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
        },
        "tags": [
            {"name": TGI_TAG, "description": "Hugging Face Text Generation Inference API"},
            {"name": OPENAI_TAG, "description": "OpenAI-compatible API"},
            {"name": ANTHROPIC_TAG, "description": "Anthropic-compatible Messages API"},
        ],
        "paths": _paths(playground),
        "components": {
            "schemas": contract.components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }


# The files of Swagger UI that /docs loads, by name, with their media types: nothing else in the
# package's directory is served. Their URLs carry the package's version, so a browser may keep
# them for a year and still gets new files after an upgrade.
SWAGGER_UI_ASSETS = {
    "swagger-ui.css": "text/css; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "favicon-32x32.png": "image/png",
    "favicon-16x16.png": "image/png",
}
_ASSET_CACHE = "public, max-age=31536000, immutable"


def _asset(name: str) -> str:
    """The URL of a Swagger UI file, relative to /docs (so that it works under a path prefix)."""
    return f"docs/assets/{name}?v={_BUNDLE_VERSION}"


def _asset_path(summary: str, assets: dict[str, str], whose: str) -> dict[str, Any]:
    """The operation of a route of static files: `assets` maps their names to media types."""
    ok: dict[str, Any] = {}
    for media in assets.values():
        bare = media.split(";")[0]
        ok[bare] = {"schema": {"type": "string"}} if bare.startswith("text/") else {}
    missing = {
        "404": {
            "description": f"Not one of {whose} files",
            "content": _content(ref("ErrorResponse")),
        }
    }
    path = _get(summary, ok, "Documentation", **missing)
    path["get"]["parameters"] = [
        {
            "name": "name",
            "in": "path",
            "required": True,
            "schema": {"type": "string", "enum": list(assets)},
        }
    ]
    return path


_DOCS_HTML = f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>tgis API</title>
  <link rel="stylesheet" href="{_asset("swagger-ui.css")}">
  <link rel="icon" type="image/png" sizes="32x32" href="{_asset("favicon-32x32.png")}">
  <link rel="icon" type="image/png" sizes="16x16" href="{_asset("favicon-16x16.png")}">
</head>
<body>
  <div id="swagger-ui">
    <noscript>The interactive page needs JavaScript; the schema is at
    <a href="openapi.json">openapi.json</a>.</noscript>
  </div>
  <script src="{_asset("swagger-ui-bundle.js")}"></script>
  <script>
    window.onload = () => {{
      window.ui = SwaggerUIBundle({{ url: "openapi.json", dom_id: "#swagger-ui" }});
    }};
  </script>
</body>
</html>
"""


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json."""
    state = get_state(request)
    return JSONResponse(openapi_document(state.contract, state.config.playground))


async def docs(request: Request) -> Response:
    """GET /docs: Swagger UI over /openapi.json; its files come from this server."""
    return HTMLResponse(_DOCS_HTML)


async def docs_asset(request: Request) -> Response:
    """GET /docs/assets/{name}: one of Swagger UI's files, from the installed
    openapi-ui-bundles package; a name not in SWAGGER_UI_ASSETS is a 404."""
    name: str = request.path_params["name"]
    media_type = SWAGGER_UI_ASSETS.get(name)
    if media_type is None:
        raise HTTPException(404, f"{name!r} is not one of Swagger UI's files")
    return FileResponse(
        _SWAGGER_UI_DIR / name, media_type=media_type, headers={"cache-control": _ASSET_CACHE}
    )
