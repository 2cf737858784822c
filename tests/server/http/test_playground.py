"""The playground's routes: GET / gives a browser the page (and probes /health's answer), its
files come from the package with a CSP that allows this origin only, every file the page
references exists and is served, --no-playground removes it, and POST / stays TGI's generate.
The page itself is driven in a real browser in test_playground_browser.py."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tests.server.conftest import make_config
from tgis.server.http.playground import CSP, FILES, PLAYGROUND_DIR

HTML = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


def test_a_browser_gets_the_page_with_a_strict_policy(client: TestClient) -> None:
    page = client.get("/", headers=HTML)
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == CSP
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "<title>tgis playground</title>" in page.text
    policy = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert policy["default-src"] == "'none'"
    for directive in ("script-src", "style-src", "connect-src", "img-src"):
        assert policy[directive] == "'self'", directive


@pytest.mark.parametrize("accept", [None, "*/*", "application/json"])
def test_probes_and_api_clients_get_the_health_answer(client: TestClient, accept: str) -> None:
    headers = {"accept": accept} if accept else {}
    response = client.get("/", headers=headers)
    health = client.get("/health")
    assert (response.status_code, response.content) == (health.status_code, health.content)
    assert "content-security-policy" not in response.headers


def test_post_root_is_still_generate(client: TestClient) -> None:
    response = client.post(
        "/", headers=HTML, json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    )
    assert response.status_code == 200
    assert "generated_text" in response.json()[0]


def referenced(text: str) -> set[str]:
    """The playground files a page or module names: src/href attributes and ES imports."""
    names = set(re.findall(r'(?:src|href)="playground/([\w.-]+)"', text))
    names |= set(re.findall(r'from "\./([\w.-]+)"', text))
    return names


def test_every_file_the_page_names_is_served(client: TestClient) -> None:
    seen: set[str] = set()
    todo = referenced(client.get("/", headers=HTML).text)
    assert {"app.js", "style.css", "icon.svg"} <= todo
    while todo:
        name = todo.pop()
        seen.add(name)
        response = client.get(f"/playground/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-security-policy"] == CSP
        expected = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
        assert response.headers["content-type"].startswith(expected[name[name.rindex(".") :]])
        assert response.content == (PLAYGROUND_DIR / name).read_bytes()
        todo |= referenced(response.text) - seen
    # Every shipped file is used: nothing dead is served.
    assert seen == set(FILES) - {"index.html"}


def test_the_page_loads_nothing_from_elsewhere() -> None:
    for name in FILES:
        text = (PLAYGROUND_DIR / name).read_text()
        # No absolute URL is fetched: no CDN, no font service (links in comments aside).
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S) if name != "icon.svg" else ""
        assert not re.search(r"""(?:src|href|url\(|fetch\(|import)\s*=?\s*["'(]?https?:""", code)
        # No inline script or style that the CSP would block.
        if name == "index.html":
            assert "<script>" not in text and "<style" not in text
            assert not re.search(r"\s(?:style|on\w+)=", text)


@pytest.mark.parametrize("name", ["index.html", "nothing.js", "..%2Fplayground.py", "app.py"])
def test_other_names_are_not_found(client: TestClient, name: str) -> None:
    response = client.get(f"/playground/{name}")
    assert response.status_code == 404


def test_no_playground_removes_the_page_and_its_files(
    make_app: Callable[..., Starlette],
) -> None:
    app = make_app(config=make_config(playground=False))
    with TestClient(app) as client:
        page = client.get("/", headers=HTML)
        assert page.status_code == 200
        assert page.content == client.get("/health").content
        assert "content-security-policy" not in page.headers
        assert client.get("/playground/app.js").status_code == 404


def test_openapi_lists_the_files_while_they_are_served(
    client: TestClient, make_app: Callable[..., Starlette]
) -> None:
    operation = client.get("/openapi.json").json()["paths"]["/playground/{name}"]["get"]
    [name] = operation["parameters"]
    assert set(name["schema"]["enum"]) == set(FILES) - {"index.html"}
    assert "404" in operation["responses"]
    with TestClient(make_app(config=make_config(playground=False))) as off:
        assert "/playground/{name}" not in off.get("/openapi.json").json()["paths"]


def test_the_page_is_open_while_the_api_wants_a_key(make_app: Callable[..., Starlette]) -> None:
    with TestClient(make_app(api_key="secret")) as client:
        assert client.get("/", headers=HTML).status_code == 200
        assert client.get("/playground/app.js").status_code == 200
        assert client.post("/", json={"inputs": "Hi"}).status_code == 401
        assert client.get("/v1/models").status_code == 401


def test_the_recorded_sizes_are_the_files_sizes() -> None:
    """docs/playground.md's size table is the shipped files' (scripts/playground_screenshots.py
    --sizes prints it again after a change)."""
    docs = (PLAYGROUND_DIR.parents[2] / "docs" / "playground.md").read_text()
    recorded = {
        m[1]: int(m[2].replace(",", "")) for m in re.finditer(r"\| ([\w.]+) \| ([\d,]+) \|", docs)
    }
    assert recorded == {n: (PLAYGROUND_DIR / n).stat().st_size for n in FILES}
    total = sum(recorded.values())
    assert f"{total:,} bytes in {len(FILES)} files" in docs
