"""Screenshots of the playground for docs/playground.md, and the size of its files.

Starts `tgis serve` on the bundled model (or uses --url), drives headless Chromium with
Playwright through a chat, a raw completion with a token's details, and the server panel
under some load, and writes docs/img/playground-{chat,completion,server}.png.

    .venv/bin/python scripts/playground_screenshots.py [--url http://127.0.0.1:3000]
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from playwright.sync_api import Page, expect, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img"
sys.path.insert(0, str(ROOT))

from tgis.server.http.playground import FILES, PLAYGROUND_DIR  # noqa: E402


@contextmanager
def served(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tgis", "serve", "--hostname", "127.0.0.1",
               "--port", str(port), "--no-grpc", "--no-compile"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("tgis serve did not start")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def load(base: str, stop: threading.Event) -> None:
    """Requests of 64 sampled tokens from 4 concurrent clients, so that the live figures move."""

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                http.post(f"{base}/generate", json={"inputs": "Once upon a time",
                          "parameters": {"max_new_tokens": 64, "do_sample": True}})  # fmt: skip

    for _ in range(4):
        threading.Thread(target=client, daemon=True).start()


def chat(page: Page) -> None:
    page.fill("#p-max-new-tokens", "40")
    page.fill("#p-temperature", "0.8")
    page.fill("#p-seed", "11")
    page.click("details.system summary")
    page.fill("#system-prompt", "You are a helpful assistant.")
    for text in ("What can you tell me about Paris?", "And about Lyon?"):
        page.fill("#message-input", text)
        page.press("#message-input", "Enter")
        expect(page.locator("#send")).to_be_enabled(timeout=120_000)
    page.click("details.system summary")  # folded again, for room
    page.screenshot(path=OUT / "playground-chat.png")


def completion(page: Page) -> None:
    page.click("#tab-complete")
    page.fill("#prompt-input", "The capital of France is")
    page.fill("#compare-with", '{"temperature": 1.0, "do_sample": true, "seed": 7}')
    page.click("#run-complete")
    expect(page.locator("#run-complete")).to_be_enabled(timeout=120_000)
    page.locator(".run").first.locator(".tok").nth(3).hover()
    page.screenshot(path=OUT / "playground-completion.png")


def server(page: Page, base: str) -> None:
    stop = threading.Event()
    load(base, stop)
    page.click("#tab-server")
    time.sleep(20)
    page.screenshot(path=OUT / "playground-server.png", full_page=True)
    stop.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running tgis serve (default: start one on the demo model)")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--sizes", action="store_true", help="print the file sizes only")
    args = parser.parse_args()
    if args.sizes:
        print_sizes()
        return
    OUT.mkdir(parents=True, exist_ok=True)
    with served(args.url) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(base + "/")
        expect(page.locator("#model-name")).not_to_have_text("connecting…")
        chat(page)
        completion(page)
        server(page, base)
        browser.close()
    print_sizes()


def print_sizes() -> None:
    """Each file's bytes, their total, and the total gzipped as one stream (level 9)."""
    contents = {name: (PLAYGROUND_DIR / name).read_bytes() for name in FILES}
    for name, data in contents.items():
        print(f"{name:14} {len(data):7,d} bytes")
    whole = b"".join(contents.values())
    print(f"{'total':14} {len(whole):7,d} bytes in {len(contents)} files")
    print(f"{'gzipped':14} {len(gzip.compress(whole, 9)):7,d} bytes")


if __name__ == "__main__":
    main()
