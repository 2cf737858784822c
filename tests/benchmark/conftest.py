"""Fixtures of the benchmark tests: the tiny tokenizer, small sessions, a live FakeEngine server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.factories import tiny_tokenizer
from tests.server.conftest import CHAT_TEMPLATE, live_server, make_config
from tests.server.fakes import FakeEngine
from tgis.benchmark.profiles import LengthDistribution, Profile
from tgis.server import ModelInfo, create_app

# Small enough for make_config's limits (100 input tokens, 128 in all) over three turns.
SMALL = Profile(
    "small",
    "tiny prompts and answers for tests",
    prompt=LengthDistribution(12, 8, 16, 3.0),
    decode=LengthDistribution(6, 4, 8, 1.0),
)


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
