"""The playground: the browser page at `GET /` — chat, raw completion, parameters, server panel.

The page is plain ES modules, a stylesheet and an icon in tgis/assets/playground/, served from
the installed package: no CDN and no build step, so it works offline and on an air-gapped
cluster. It talks to this server only, through its public routes (/v1/chat/completions,
/generate_stream, /info, /metrics, /v1/models), with the API key the user types sent as a
Bearer header. Its Content-Security-Policy allows nothing but this origin.

`GET /` is negotiated: a request that accepts HTML (a browser) gets the page, anything else
(load balancers' probes, TGI clients) gets /health's answer as before. `POST /` is TGI's
generate either way. `--no-playground` removes the page and its files.
"""

from __future__ import annotations

from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

PLAYGROUND_DIR = Path(__file__).resolve().parents[2] / "assets" / "playground"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The page and its files come from this origin, and it talks to nothing else: no inline script
# or style, no frames, no plugins, no form posts elsewhere.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    # Asked for at every load (72 KB), so an upgraded server's files are used at once.
    "cache-control": "no-cache",
}


def _files() -> dict[str, str]:
    """The page's files by name, with their media types (read once: the package is fixed)."""
    if not PLAYGROUND_DIR.is_dir():
        return {}
    return {
        p.name: MEDIA_TYPES[p.suffix]
        for p in sorted(PLAYGROUND_DIR.iterdir())
        if p.is_file() and p.suffix in MEDIA_TYPES
    }


FILES = _files()
# What /playground/{name} serves: everything but the page, which only GET / answers with.
ASSETS = {name: media for name, media in FILES.items() if name != "index.html"}


def wants_page(request: Request) -> bool:
    """A browser's navigation to / (its Accept names HTML); probes and API clients send
    `*/*`, `application/json` or nothing."""
    return "text/html" in request.headers.get("accept", "")


def page() -> Response:
    """The playground's HTML."""
    return FileResponse(
        PLAYGROUND_DIR / "index.html", media_type=MEDIA_TYPES[".html"], headers=SECURITY_HEADERS
    )


async def asset(request: Request) -> Response:
    """GET /playground/{name}: one of the page's files; any other name is a 404."""
    name: str = request.path_params["name"]
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(404, f"{name!r} is not one of the playground's files")
    return FileResponse(PLAYGROUND_DIR / name, media_type=media_type, headers=SECURITY_HEADERS)


ROUTES = [Route("/playground/{name}", asset, methods=["GET"])]
