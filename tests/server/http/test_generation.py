"""The request pipeline through `tgis serve`'s app on the demo model: what a request reads of the
tokenizer was read at start-up."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.engine.test_detokenize import count_vocabulary_walks
from tests.server.conftest import demo_app
from tgis import launch


def test_requests_never_walk_the_vocabulary(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts as text and as token ids, logit_bias, details, chat and grammars: none calls
    a vocabulary walk of the tokenizer (`len(tokenizer)` and the like: a tenth of a second
    each, holding the GIL, with a 128k-token vocabulary) once the server has started."""
    counts: list[Counter[str]] = []
    load = launch.load_tokenizer

    def counted_load(model_dir: Path, what: str = "the model") -> Any:
        tokenizer = load(model_dir, what)
        counts.append(count_vocabulary_walks(tokenizer))
        return tokenizer

    monkeypatch.setattr(launch, "load_tokenizer", counted_load)
    with demo_app(demo_model_dir, 256) as app, TestClient(app) as client:
        assert app.state.tgis.engine.grammars.wait(60)
        assert client.get("/health").status_code == 200
        (walks,) = counts
        started = sum(walks.values())
        ids = app.state.tgis.tokenizer.encode("def main():")
        bodies: list[tuple[str, dict[str, Any]]] = [
            ("/generate", {"inputs": "def f(", "parameters": {"max_new_tokens": 3}}),
            ("/generate", {"inputs": "import os", "parameters": {
                "max_new_tokens": 3, "details": True, "top_n_tokens": 2,
                "decoder_input_details": True, "stop": ["\n"], "best_of": 2, "do_sample": True,
            }}),
            ("/generate_stream", {"inputs": "class A:", "parameters": {"max_new_tokens": 3}}),
            ("/generate", {"inputs": "x =", "parameters": {
                "max_new_tokens": 8, "grammar": {"type": "regex", "value": "[0-9]{2}"},
            }}),
            ("/v1/completions", {"prompt": ids, "max_tokens": 3, "logit_bias": {"5": 10}}),
            ("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "response_format": {"type": "json_object"}, "logit_bias": {"7": -5},
            }),
        ]  # fmt: skip
        for path, body in bodies * 2:
            response = client.post(path, json=body)
            assert response.status_code == 200, (path, response.text)
        assert sum(walks.values()) == started, walks
