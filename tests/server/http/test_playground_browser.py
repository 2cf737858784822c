"""The playground in a real browser: headless Chromium driven by Playwright.

Against `tgis serve` on the bundled model (a subprocess): the page loads with no console
errors and no request leaving the server's origin; a chat message streams a reply equal to
what /v1/chat/completions answers; a raw completion shows each token's logprob and
alternatives equal to /generate's details; the server panel shows the model id and live
figures; a wrong API key shows the server's 401, the right one works.

Against a live server over a scripted engine (a Qwen3-style template): reasoning in a
collapsible block, tool calls as structured blocks, markdown rendered and model-written HTML
shown as text; stop, regenerate and edit; conversations exported and imported; parameters
sent as typed and remembered across a reload. The page's own parsers (markdown, server-sent
events, Prometheus text) are checked in the browser too.

Chromium is Debian's `chromium` package (`.ci/run` installs it); TGIS_CHROMIUM names another
binary. Where there is none, the tests skip and say so.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright, expect, sync_playwright

from tests.server.chat.test_reasoning_routes import CALL, THOUGHT, WEATHER
from tests.server.conftest import demo_serve, live_server, make_config
from tests.server.fakes import FakeEngine
from tgis.config.env import DEMO_MODEL
from tgis.server import ModelInfo, create_app

ROOT = Path(__file__).resolve().parents[3]
KEY = "playground-secret"
TIMEOUT_MS = 60_000
expect.set_options(timeout=TIMEOUT_MS)


def chromium_path() -> str | None:
    given = os.environ.get("TGIS_CHROMIUM")
    if given:
        return given
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    path = chromium_path()
    if path is None:
        pytest.skip("Chromium is not installed (apt-get install chromium, or set TGIS_CHROMIUM)")
    # --no-sandbox: CI runs as root, where Chromium's sandbox cannot start.
    browser = playwright.chromium.launch(executable_path=path, args=["--no-sandbox"])
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, browser: Browser) -> Iterator[str]:
    log = tmp_path_factory.mktemp("playground") / "serve.log"
    with demo_serve(log, "--max-total-tokens", "512") as url:
        yield url


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, browser: Browser) -> Iterator[str]:
    log = tmp_path_factory.mktemp("playground-key") / "serve.log"
    with demo_serve(log, "--max-total-tokens", "512", "--api-key", KEY) as url:
        yield url


class Watched:
    """A page in a fresh browser context (its own storage), with what it logged and asked."""

    def __init__(self, browser: Browser, base: str) -> None:
        self.context = browser.new_context(accept_downloads=True)
        self.page: Page = self.context.new_page()
        self.base = base
        self.console: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.set_default_timeout(TIMEOUT_MS)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type in ("error", "warning"):
            self.console.append(f"{message.type}: {message.text}")

    def open(self) -> Page:
        self.page.goto(self.base + "/")
        expect(self.page.locator("#model-name")).not_to_have_text("connecting…")
        return self.page

    def outside(self) -> list[str]:
        origin = urlsplit(self.base)
        return [u for u in self.requests if urlsplit(u)[:2] != origin[:2]]


@contextmanager
def watched(browser: Browser, base: str) -> Iterator[Watched]:
    w = Watched(browser, base)
    try:
        yield w
    finally:
        w.context.close()


def set_params(page: Page, **values: str) -> None:
    for name, value in values.items():
        page.fill(f"#params-form [name={name}]", value)


def stored_conversations(page: Page) -> list[dict[str, Any]]:
    raw = page.evaluate("() => localStorage.getItem('tgis.playground.conversations')")
    return json.loads(raw)


def send_chat(page: Page, text: str) -> None:
    page.fill("#message-input", text)
    page.press("#message-input", "Enter")
    expect(page.locator("#stop-chat")).to_be_disabled()
    expect(page.locator("#send")).to_be_enabled()


# --- against `tgis serve` on the bundled model ---------------------------------------------


def test_the_page_loads_with_no_errors_and_nothing_from_elsewhere(
    browser: Browser, demo: str
) -> None:
    with watched(browser, demo) as w:
        response = w.page.goto(demo + "/")
        assert response is not None and response.ok
        assert "content-security-policy" in response.headers
        expect(w.page.locator("#model-name")).to_have_text(str(DEMO_MODEL))
        for tab in ("complete", "server", "chat"):
            w.page.click(f"#tab-{tab}")
            expect(w.page.locator(f"#view-{tab}")).to_be_visible()
        expect(w.page.locator("#live-state")).to_contain_text("updated")
        assert w.console == []
        assert w.outside() == []
        served = {urlsplit(u).path for u in w.requests}
        assert {"/", "/playground/app.js", "/info", "/v1/models", "/metrics"} <= served


def test_a_chat_message_streams_the_servers_reply(browser: Browser, demo: str) -> None:
    with watched(browser, demo) as w:
        page = w.open()
        set_params(page, max_new_tokens="12", temperature="0")
        send_chat(page, "Hello there")
        reply = page.locator("#messages li.assistant")
        expect(reply).to_have_count(1)
        expect(page.locator("#chat-usage")).to_contain_text("12 generated tokens")
        # The conversation holds exactly what the server answers the same request.
        answer = httpx.post(
            demo + "/v1/chat/completions",
            json={"model": "tgi", "messages": [{"role": "user", "content": "Hello there"}],
                  "max_tokens": 12, "temperature": 0},
            timeout=60,
        ).json()  # fmt: skip
        stored = stored_conversations(page)[0]["messages"]
        assert [m["role"] for m in stored] == ["user", "assistant"]
        assert stored[1]["content"] == answer["choices"][0]["message"]["content"]
        assert stored[1]["content"].strip()
        assert w.console == [] and w.outside() == []


def test_a_raw_completion_shows_each_tokens_details(browser: Browser, demo: str) -> None:
    prompt = "The capital of France is"
    with watched(browser, demo) as w:
        page = w.open()
        set_params(page, max_new_tokens="8", temperature="0")
        page.click("#tab-complete")
        page.fill("#prompt-input", prompt)
        page.click("#run-complete")
        footer = page.locator(".run footer")
        expect(footer).to_contain_text("finish: length")
        expect(footer).to_contain_text("8 tokens")
        details = httpx.post(
            demo + "/generate",
            json={"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True,
                                                   "top_n_tokens": 5}},
            timeout=60,
        ).json()["details"]  # fmt: skip
        tokens = page.locator(".output .tok")
        expect(tokens).to_have_count(8)
        assert tokens.all_inner_texts() == [t["text"] for t in details["tokens"]]
        for i in (0, 7):
            tokens.nth(i).hover()
            tip = page.locator("#tooltip")
            expect(tip).to_be_visible()
            expected = details["tokens"][i]
            expect(tip).to_contain_text(f"id {expected['id']}")
            expect(tip).to_contain_text(f"logprob {expected['logprob']:.3f}")
            rows = tip.locator("tbody tr")
            expect(rows).to_have_count(5)
            top = details["top_tokens"][i]
            assert [r.split("\t")[1] for r in rows.all_inner_texts()] == [
                f"{t['logprob']:.3f}" for t in top
            ]
        # Keyboard: focus the output and step through the tokens with the arrow keys.
        page.focus(".output")
        page.keyboard.press("ArrowRight")
        expect(page.locator("#tooltip")).to_contain_text(f"id {details['tokens'][0]['id']}")
        page.keyboard.press("ArrowRight")
        expect(page.locator("#tooltip")).to_contain_text(f"id {details['tokens'][1]['id']}")
        assert w.console == [] and w.outside() == []


def test_compare_runs_two_settings_side_by_side(browser: Browser, demo: str) -> None:
    with watched(browser, demo) as w:
        page = w.open()
        set_params(page, max_new_tokens="6", temperature="0")
        page.click("#tab-complete")
        page.fill("#prompt-input", "Once upon a time")
        page.fill("#compare-with", '{"max_new_tokens": 3}')
        page.click("#run-complete")
        runs = page.locator(".run")
        expect(runs).to_have_count(2)
        expect(runs.nth(0).locator("footer")).to_contain_text("6 tokens")
        expect(runs.nth(1).locator("footer")).to_contain_text("3 tokens")
        first = runs.nth(0).locator(".tok").all_inner_texts()
        assert runs.nth(1).locator(".tok").all_inner_texts() == first[:3]  # greedy: a prefix
        page.fill("#compare-with", "[1]")
        page.click("#run-complete")
        expect(page.locator("#notice")).to_contain_text('"Compare with" must be a JSON object')


def test_the_server_panel_shows_the_model_and_live_figures(browser: Browser, demo: str) -> None:
    with watched(browser, demo) as w:
        page = w.open()
        page.click("#tab-server")
        info = page.locator("#info")
        expect(info).to_contain_text(str(DEMO_MODEL))
        expect(info).to_contain_text("paged")
        expect(info).to_contain_text("Max total tokens512")
        live = page.locator("#live")
        expect(live).to_contain_text("Queued requests")
        expect(live).to_contain_text("Time to first token")
        expect(page.locator("#live-state")).to_contain_text("updated")
        # The parameters panel makes room for the server panel, and comes back.
        expect(page.locator("#params")).to_be_hidden()
        page.click("#tab-chat")
        expect(page.locator("#params")).to_be_visible()


def test_a_wrong_api_key_shows_the_servers_error(browser: Browser, keyed: str) -> None:
    with watched(browser, keyed) as w:
        page = w.open()
        # /v1/models needs the key: the page says so at load.
        expect(page.locator("#notice")).to_contain_text("API key")
        page.fill("#api-key", "wrong")
        page.press("#api-key", "Enter")
        set_params(page, max_new_tokens="4")
        send_chat(page, "Hello")
        error = page.locator("#messages li.assistant .error")
        expect(error).to_have_text("401: Unauthorized")
        expect(page.locator("#notice")).to_contain_text("401: Unauthorized")
        page.fill("#api-key", KEY)
        page.press("#api-key", "Enter")
        page.click("#regenerate")
        expect(page.locator("#send")).to_be_enabled()
        expect(page.locator("#messages li.assistant .error")).to_have_count(0)
        expect(page.locator("#chat-usage")).to_contain_text("4 generated tokens")
        # The key travels as a header, never in a URL, and stays out of localStorage.
        assert not [u for u in w.requests if "wrong" in u or KEY in u]
        assert page.evaluate("() => localStorage.getItem('tgis.playground.apiKey')") is None
        assert page.evaluate("() => sessionStorage.getItem('tgis.playground.apiKey')") == KEY


# --- against a scripted engine ------------------------------------------------------------

INJECTED = '<img src=x onerror="window.pwned=1">'
ANSWER = f"**Paris** is sunny. Run `ls` then:\n\n```sh\necho {INJECTED}\n```\n\n- one\n- two"
TOOL_SCRIPT = f"{THOUGHT}\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>"
TEXT_SCRIPT = f"{THOUGHT}\n</think>\n\n{ANSWER}\n\n{INJECTED}"


@contextmanager
def scripted_server(
    tokenizer: Any, script: str, delay: float = 0.0
) -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(tokenizer, script=script, delay=delay)
    engine.eos_after = len(engine.script_ids)
    config = make_config(max_input_tokens=400, max_total_tokens=600, max_batch_prefill_tokens=600)
    app = create_app(engine, tokenizer, config, ModelInfo.from_config(config))
    with live_server(app) as (base, _):
        yield base, engine


def test_reasoning_markdown_and_tool_calls_render_safely(
    browser: Browser, qwen3_tokenizer: Any
) -> None:
    with scripted_server(qwen3_tokenizer, TEXT_SCRIPT) as (base, _), watched(browser, base) as w:
        page = w.open()
        send_chat(page, "Weather in Paris?")
        reply = page.locator("#messages li.assistant")
        reasoning = reply.locator("details.reasoning")
        expect(reasoning).to_have_count(1)
        assert reasoning.get_attribute("open") is None  # folded once the answer came
        expect(reasoning.locator(".md")).to_be_hidden()
        reasoning.locator("summary").click()
        expect(reasoning.locator(".md")).to_contain_text("The user asks about Paris.")
        md = reply.locator(":scope > .md")
        expect(md.locator("strong")).to_have_text("Paris")
        expect(md.locator("p code")).to_have_text("ls")
        expect(md.locator("pre code")).to_have_text(f"echo {INJECTED}")
        expect(md.locator("li")).to_have_text(["one", "two"])
        # The model's HTML is text, not markup: no image, no handler ran.
        expect(page.locator("#messages img")).to_have_count(0)
        expect(md.locator(":scope > p").last).to_have_text(INJECTED)
        assert page.evaluate("() => window.pwned") is None
        assert w.console == [] and w.outside() == []
    with (
        scripted_server(qwen3_tokenizer, TOOL_SCRIPT) as (base, engine),
        watched(browser, base) as w,
    ):
        page = w.open()
        page.click("details.system summary")
        page.fill("#chat-tools", json.dumps([WEATHER]))
        send_chat(page, "Weather in Paris?")
        call = page.locator("#messages li.assistant .tool-call")
        expect(call).to_have_count(1)
        expect(call.locator(".tool-name code")).to_have_text("get_weather")
        assert json.loads(call.locator("pre").inner_text()) == {"city": "Paris"}
        assert "get_weather" in qwen3_tokenizer.decode(engine.requests[-1].input_ids)
        # The result goes back as a tool message answering that call.
        expect(page.locator("#send-as option[value=tool]")).to_be_enabled()
        page.select_option("#send-as", "tool")
        send_chat(page, '{"sky": "clear"}')
        prompt = qwen3_tokenizer.decode(engine.requests[-1].input_ids)
        assert '<|im_start|>tool\n{"sky": "clear"}' in prompt
        assert "<tool_call>" in prompt  # the call itself is in the history
        expect(page.locator("#messages li.tool")).to_contain_text("for call call_")


def test_stop_regenerate_and_edit(browser: Browser, qwen3_tokenizer: Any) -> None:
    with (
        scripted_server(qwen3_tokenizer, TEXT_SCRIPT, delay=0.02) as (base, engine),
        watched(browser, base) as w,
    ):
        page = w.open()
        page.fill("#message-input", "First question")
        page.press("#message-input", "Enter")
        expect(page.locator("#stop-chat")).to_be_enabled()
        page.click("#stop-chat")
        expect(page.locator("#messages li.assistant .meta")).to_have_text("stopped")
        assert engine.cancel_seen.wait(10)
        page.click("#regenerate")
        expect(page.locator("#send")).to_be_enabled()
        expect(page.locator("#messages li.assistant")).to_have_count(1)
        expect(page.locator("#messages li.assistant strong")).to_have_text("Paris")
        assert len(engine.requests) == 2
        assert engine.requests[0].input_ids == engine.requests[1].input_ids
        page.click("#messages li.user button:text('Edit')")
        page.fill("#messages li.user textarea", "Second question")
        page.click("button:text('Save and send')")
        expect(page.locator("#send")).to_be_enabled()
        assert len(engine.requests) == 3
        prompt = qwen3_tokenizer.decode(engine.requests[2].input_ids)
        assert "Second question" in prompt and "First question" not in prompt
        stored = stored_conversations(page)[0]["messages"]
        assert [m["role"] for m in stored] == ["user", "assistant"]
        assert stored[0]["content"] == "Second question"


def test_conversations_export_and_import(
    browser: Browser, qwen3_tokenizer: Any, tmp_path: Path
) -> None:
    with scripted_server(qwen3_tokenizer, TEXT_SCRIPT) as (base, _):
        with watched(browser, base) as w:
            page = w.open()
            page.click("details.system summary")
            page.fill("#system-prompt", "Be brief.")
            send_chat(page, "Weather in Paris?")
            with page.expect_download() as download:
                page.click("#export-chats")
            exported = tmp_path / "chats.json"
            download.value.save_as(exported)
        data = json.loads(exported.read_text())
        assert data["format"] == "tgis-playground"
        [conversation] = data["conversations"]
        assert conversation["system"] == "Be brief."
        assert conversation["messages"][1]["reasoning"].startswith("The user asks")
        with watched(browser, base) as w:  # a fresh browser: nothing stored
            page = w.open()
            expect(page.locator("#messages li")).to_have_count(0)
            page.set_input_files("#import-chats", str(exported))
            expect(page.locator("#notice")).to_have_text("Imported 1 conversation.")
            expect(page.locator("#messages li.assistant strong")).to_have_text("Paris")
            page.click("details.system summary")
            expect(page.locator("#system-prompt")).to_have_value("Be brief.")
            bad = tmp_path / "bad.json"
            wrong_call = {"role": "assistant", "content": "", "tool_calls": {"name": 1}}
            for conversations in ([{"id": "x", "messages": "nope"}],
                                  [{"id": "x", "messages": [wrong_call]}]):  # fmt: skip
                bad.write_text(json.dumps({"conversations": conversations}))
                page.set_input_files("#import-chats", str(bad))
                expect(page.locator("#notice")).to_contain_text("not a conversations export")
            assert len(stored_conversations(page)) == 2  # the import and the fresh chat


def test_parameters_are_sent_as_typed_and_remembered(
    browser: Browser, qwen3_tokenizer: Any
) -> None:
    with (
        scripted_server(qwen3_tokenizer, TEXT_SCRIPT) as (base, engine),
        watched(browser, base) as w,
    ):
        page = w.open()
        set_params(page, temperature="0.5", top_k="7", top_p="0.9", seed="3",
                   repetition_penalty="1.2", max_new_tokens="40", stop="xyz\nabc")  # fmt: skip
        page.reload()
        expect(page.locator("#p-top-k")).to_have_value("7")
        expect(page.locator("#p-stop")).to_have_value("xyz\nabc")
        send_chat(page, "Hi")
        params = engine.requests[-1].params
        assert (params.temperature, params.top_k, params.top_p, params.seed) == (0.5, 7, 0.9, 3)
        assert (params.repetition_penalty, params.max_new_tokens) == (1.2, 40)
        assert params.stop == ("xyz", "abc")
        # Raw completion sends TGI's parameters, a regex grammar among them.
        page.select_option("#p-grammar-type", "regex")
        page.fill("#p-grammar", "[a-z]+")
        page.click("#tab-complete")
        page.fill("#prompt-input", "Hello")
        page.click("#run-complete")
        expect(page.locator(".run footer")).to_contain_text("finish:")
        grammar = engine.requests[-1].params.grammar
        assert grammar is not None and grammar.kind == "regex" and grammar.value == "[a-z]+"
        # Compare with {"temperature": 0}: the same prompt greedy beside the sampled one.
        page.select_option("#p-grammar-type", "")
        page.fill("#compare-with", '{"temperature": 0}')
        page.click("#run-complete")
        expect(page.locator(".run footer")).to_have_count(2)
        expect(page.locator(".run footer").nth(1)).to_contain_text("finish:")
        expect(page.locator(".run footer").nth(0)).to_contain_text("finish:")
        sampled, greedy = sorted(engine.requests[-2:], key=lambda r: not r.params.do_sample)
        assert (sampled.params.do_sample, sampled.params.temperature) == (True, 0.5)
        assert (sampled.params.top_k, sampled.params.top_p) == (7, 0.9)
        assert not greedy.params.do_sample
        assert (greedy.params.top_k, greedy.params.top_p, greedy.params.seed) == (None, None, 3)
        page.fill("#compare-with", "")
        page.select_option("#p-grammar-type", "regex")
        # Chat takes a JSON schema only: a regex is refused in the page, before any request.
        sent = len(engine.requests)
        page.click("#tab-chat")
        page.fill("#message-input", "Again")
        page.press("#message-input", "Enter")
        expect(page.locator("#notice")).to_contain_text("regex grammar applies to raw completion")
        assert len(engine.requests) == sent
        expect(page.locator("#message-input")).to_have_value("Again")  # kept, to send once fixed
        page.select_option("#p-grammar-type", "json")
        page.fill("#p-grammar", "{not json")
        page.click("#send")
        expect(page.locator("#notice")).to_contain_text("JSON schema does not parse")
        page.click("#reset-params")
        expect(page.locator("#p-top-k")).to_have_value("")


def test_the_pages_parsers(browser: Browser, qwen3_tokenizer: Any) -> None:
    with scripted_server(qwen3_tokenizer, TEXT_SCRIPT) as (base, _), watched(browser, base) as w:
        page = w.open()
        result = page.evaluate(
            """async () => {
              const md = await import("./playground/markdown.js");
              const api = await import("./playground/api.js");
              const server = await import("./playground/server.js");
              const box = document.createElement("div");
              box.append(md.renderMarkdown(
                "<script>window.pwned=1</script>\\n[x](javascript:alert(1)) ![i](http://e.x/i.png)" +
                "\\n\\n| a | b |\\n|---|---|\\n| 1 | **2** |\\n\\n> quoted\\n\\n1. first\\n2. second"));
              const nested = document.createElement("div");
              nested.append(md.renderMarkdown("1. step\\n   ```py\\n   if x:\\n       y()\\n   ```\\n2. next"));
              const deep = document.createElement("div");
              deep.append(md.renderMarkdown(">".repeat(5000) + " x\\n# Learn C#"));
                            const events = new api.EventParser();
              const parsed = [...events.push('data:{"a":'), ...events.push('1}\\n\\ndata: [DONE]\\n'),
                              ...events.push("\\n: comment\\nevent: x\\ndata: 2\\n\\n"),
                              ...events.push("data: 3\\r"), ...events.push("\\ndata: 4\\r\\n\\r\\n")];
              const text = "# HELP q x\\ntgi_queue_size 3\\n" +
                'tgi_batch_inference_batch_size_sum{method="next_token"} 100\\n' +
                'tgi_batch_inference_batch_size_sum{method="prefill"} 7\\n' +
                "tgis_request_time_to_first_token_seconds_sum 0.5\\n" +
                "tgis_request_time_to_first_token_seconds_count 2\\n";
              const later = text.replace("} 100", "} 300").replace("sum 0.5", "sum 0.9")
                .replace("count 2", "count 4");
              const f0 = server.figures(server.parseMetrics(text), 0, null);
              const f1 = server.figures(server.parseMetrics(later), 2000, f0);
              return {
                nestedCode: nested.querySelector("ol li pre code")?.textContent,
                nestedItems: nested.querySelectorAll("ol > li").length,
                deepPlain: deep.querySelector("p.plain") !== null,
                heading: deep.querySelector("h3")?.textContent,
                html: box.innerHTML,
                scripts: box.querySelectorAll("script, img").length,
                links: [...box.querySelectorAll("a")].map((a) => a.href),
                cells: [...box.querySelectorAll("td")].map((td) => td.innerHTML),
                quote: box.querySelector("blockquote")?.textContent,
                items: [...box.querySelectorAll("ol li")].map((li) => li.textContent),
                parsed, queue: f1.queue, rate: f1.tokensPerSecond, ttft: f1.ttft,
                firstTtft: f0.ttft,
              };
            }"""
        )
        assert result["nestedCode"] == "if x:\n    y()"  # the item's indent, not the code's
        assert result["nestedItems"] == 2
        assert result["deepPlain"] and result["heading"] == "Learn C#"
        assert result["scripts"] == 0
        assert "&lt;script&gt;window.pwned=1&lt;/script&gt;" in result["html"]
        assert result["links"] == ["http://e.x/i.png"]  # javascript: is not a link; images are
        assert result["cells"] == ["1", "<strong>2</strong>"]
        assert result["quote"] == "quoted"
        assert result["items"] == ["first", "second"]
        assert result["parsed"] == ['{"a":1}', "[DONE]", "2", "3\n4"]  # CRLF split in two
        assert result["queue"] == 3
        assert result["rate"] == pytest.approx(100.0)  # 200 decode tokens in 2 s
        assert result["ttft"] == pytest.approx(0.2)  # 0.4 s over the 2 requests since
        assert result["firstTtft"] == pytest.approx(0.25)
