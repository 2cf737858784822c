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
from tgis.server.http.openapi_schemas import content, get, ref
from tgis.server.http.playground import ASSETS as PLAYGROUND_ASSETS
from tgis.server.http.state import get_state

if TYPE_CHECKING:
    from tgis.server.http.contract import RequestContract


def _paths(playground: bool) -> dict[str, Any]:
    """The documentation's own operations (the APIs' come with the contract)."""
    paths: dict[str, Any] = {
        "/openapi.json": get("This document", content({"type": "object"}), "Documentation"),
        "/docs": get("Swagger UI", content({"type": "string"}, "text/html"), "Documentation"),
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
        "tags": list(contract.tags),
        "paths": {**contract.paths, **_paths(playground)},
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
            "content": content(ref("ErrorResponse")),
        }
    }
    path = get(summary, ok, "Documentation", **missing)
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
