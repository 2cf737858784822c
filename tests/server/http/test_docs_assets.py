"""/docs works offline: Swagger UI's files come from this server (/docs/assets/...), never a CDN."""

from __future__ import annotations

import re
from urllib.parse import urljoin, urlsplit

import anyio
from starlette.applications import Starlette
from starlette.testclient import TestClient
from starlette.types import Message

from tgis.server.http.openapi import SWAGGER_UI_ASSETS

# Every URL the page loads or links to: src="...", href="...", and the schema's `url: "..."`.
URL = re.compile(r'(?:src|href)="([^"]*)"|url:\s*"([^"]*)"')


def page_urls(html: str) -> list[str]:
    return [a or b for a, b in URL.findall(html)]


def asset_urls(html: str) -> list[str]:
    """The URLs of /docs's files, resolved as a browser resolves them against /docs."""
    return [
        urljoin("http://testserver/docs", url)
        for url in page_urls(html)
        if "openapi.json" not in url
    ]


def test_docs_page_references_no_other_origin(client: TestClient) -> None:
    html = client.get("/docs").text
    assert "http://" not in html and "https://" not in html
    urls = page_urls(html)
    assert urls, html
    for url in urls:
        parts = urlsplit(url)
        # Relative to the page (no scheme, host or leading slash): it works under a path prefix.
        assert not parts.scheme and not parts.netloc and not url.startswith("/"), url


def test_each_asset_the_page_references_is_served(client: TestClient) -> None:
    html = client.get("/docs").text
    urls = asset_urls(html)
    names = {urlsplit(url).path.rsplit("/", 1)[-1] for url in urls}
    assert {"swagger-ui.css", "swagger-ui-bundle.js"} <= names
    assert names <= set(SWAGGER_UI_ASSETS)
    for url in urls:
        response = client.get(url)
        name = urlsplit(url).path.rsplit("/", 1)[-1]
        assert response.status_code == 200, url
        assert response.headers["content-type"] == SWAGGER_UI_ASSETS[name]
        assert "max-age=31536000" in response.headers["cache-control"]
        assert int(response.headers["content-length"]) == len(response.content)
        assert len(response.content) > 500, url
    schema = next(u for u in page_urls(html) if "openapi.json" in u)
    assert client.get(urljoin("http://testserver/docs", schema)).status_code == 200


def test_the_assets_are_swagger_ui_5(client: TestClient) -> None:
    """The OpenAPI document is 3.1, which Swagger UI renders from version 5 on."""
    script = client.get("/docs/assets/swagger-ui-bundle.js")
    assert script.status_code == 200 and "SwaggerUIBundle" in script.text
    assert re.search(r'"5\.\d+\.\d+"', script.text), "no Swagger UI 5 version string"
    css = client.get("/docs/assets/swagger-ui.css")
    assert ".swagger-ui" in css.text
    icon = client.get("/docs/assets/favicon-32x32.png")
    assert icon.content.startswith(b"\x89PNG\r\n\x1a\n")


def test_asset_urls_change_with_the_package_version(client: TestClient) -> None:
    """Cached for a year, so each URL names the version of the files it serves."""
    from openapi_ui_bundles import __version__

    for url in asset_urls(client.get("/docs").text):
        assert urlsplit(url).query == f"v={__version__}", url


def test_unknown_asset_is_404(client: TestClient) -> None:
    # index.html is in the package's directory too, but is not one of the files /docs needs.
    for name in ("nope.js", "index.html", "swagger-ui-standalone-preset.js", "SWAGGER-UI.CSS"):
        response = client.get(f"/docs/assets/{name}")
        assert response.status_code == 404, name
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error_type"] == "not_found"


def request_raw_path(app: Starlette, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as given (no client normalizes its dot segments); (status, body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    anyio.run(app, scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


def test_path_traversal_is_refused(app: Starlette, client: TestClient) -> None:
    # Files that exist next to (or above) the served directory, reached through `..`.
    for path in (
        "/docs/assets/../openapi.json",
        "/docs/assets/../../swagger_ui/__init__.py",
        "/docs/assets/../../redoc/vendor/redoc.standalone.js",
        "/docs/assets/..",
        "/docs/assets/../../../../../../etc/passwd",
    ):
        status, body = request_raw_path(app, path)
        assert status == 404, path
        assert b"import" not in body and b"root:" not in body
    # The same with the slashes percent-encoded, as a client sends them.
    for path in (
        "/docs/assets/..%2F..%2Fswagger_ui%2F__init__.py",
        "/docs/assets/%2e%2e%2f%2e%2e%2f__init__.py",
        "/docs/assets/..%5C..%5C__init__.py",
    ):
        response = client.get(path)
        assert response.status_code == 404, path
