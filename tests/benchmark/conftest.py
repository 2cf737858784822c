"""Fixtures of the benchmark tests: the tiny tokenizer, small sessions, a live FakeEngine server,
and the image a data URL holds."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest

from tests.factories import tiny_tokenizer
from tests.server.conftest import CHAT_TEMPLATE, live_server, make_config
from tests.server.fakes import FakeEngine
from tgis.benchmark.profiles import LengthDistribution, Profile
from tgis.benchmark.results import build_results
from tgis.server import ModelInfo, create_app

# Small enough for make_config's limits (100 input tokens, 128 in all) over three turns.
SMALL = Profile(
    "small",
    "tiny prompts and answers for tests",
    prompt=LengthDistribution(12, 8, 16, 3.0),
    decode=LengthDistribution(6, 4, 8, 1.0),
)


def open_data_url(url: str) -> tuple[str, Any]:
    """The media type of a base64 data URL and its image, opened with Pillow (its `format`
    is the one the bytes are in)."""
    from PIL import Image

    head, payload = url.split(",", 1)
    assert head.startswith("data:") and head.endswith(";base64"), head
    image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    image.load()
    return head[len("data:") : -len(";base64")], image


def engine_results(steps: dict[int, tuple[float, float]]) -> dict[str, Any]:
    """An `--engine` results document: per batch size, (prefill p50 s, decode-step p50 s); the
    other percentiles and the mean equal p50, throughputs follow from the mean (128-token
    prompts, 16 decode steps)."""

    def latency(value: float) -> dict[str, float]:
        return {q: value for q in ("p50", "p90", "p95", "p99", "mean")}

    config = {
        "mode": "engine",
        "model": "demo",
        "device": "cpu",
        "dtype": None,
        "batch_sizes": sorted(steps),
        "prompt_tokens": 128,
        "decode_tokens": 16,
        "runs": 5,
        "seed": 0,
        "interrupted": False,
    }
    engine_steps = [
        {
            "batch_size": batch,
            "runs": 5,
            "prompt_tokens": 128,
            "decode_tokens": 16,
            "prefill_latency_s": latency(prefill),
            "prefill_tokens_per_s": batch * 128 / prefill,
            "decode_latency_s": latency(decode),
            "decode_tokens_per_s": batch / decode,
        }
        for batch, (prefill, decode) in sorted(steps.items())
    ]
    return build_results(config, [], engine_steps=engine_steps)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    # A few milliseconds per token, so that inter-token latencies are measurable.
    return FakeEngine(tokenizer, delay=0.002)


@pytest.fixture
def server_url(engine: FakeEngine, tokenizer: Any) -> Iterator[str]:
    """A real uvicorn server on 127.0.0.1 serving the TGI and OpenAI routes over FakeEngine."""
    config = make_config()
    app = create_app(
        engine=engine, tokenizer=tokenizer, config=config, model_info=ModelInfo.from_config(config)
    )
    with live_server(app, shutdown_grace_s=1.0) as (url, _):
        yield url
