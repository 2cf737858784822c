"""A property of the request validator: whatever a client sends, the answer is a 422 or a
generation that runs without error (valid JSON, finite logprobs) — never a 424 or a 500.

Hypothesis draws TGI `parameters` and OpenAI bodies from wide ranges (any finite float,
integers past 64 bits, null, wrong types, extreme lengths), through the real HTTP app over the
demo model's engine, so read_json, the parsers, tgis.params, the API's schema and the
engine's sampling are all on the path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from tests.server.conftest import demo_app

NEW_TOKENS = 2

# Mostly values a client means, sometimes the edges of what JSON can carry.
FLOATS = st.one_of(
    st.floats(min_value=-3.0, max_value=3.0),
    st.floats(min_value=0.0, max_value=2.0),
    st.sampled_from([0.0, 1e-300, 1e-8, 1e-4, 0.5, 1.0, 1.0001, 1e4, 1e5, 3.5e38, 1e308]),
    st.floats(allow_nan=False, allow_infinity=False),
)
INTS = st.one_of(
    st.integers(min_value=0, max_value=8),
    st.integers(min_value=-2, max_value=200),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]),
    st.integers(min_value=-(2**70), max_value=2**70),
)
SCALARS = st.one_of(st.none(), st.booleans(), FLOATS, INTS, st.text(max_size=8))

FLOAT_FIELDS = [
    "temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty",
    "presence_penalty",
]  # fmt: skip
INT_FIELDS = [
    "top_k", "seed", "min_new_tokens", "truncate", "top_n_tokens", "best_of", "time_limit_ms",
]  # fmt: skip
BOOL_FIELDS = [
    "do_sample", "details", "decoder_input_details", "include_stop_sequence", "ignore_eos",
    "skip_special_tokens", "return_full_text",
]  # fmt: skip


def _field(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A value of the field's kind, one time in ten anything at all."""
    return st.one_of(*[values] * 9, SCALARS)


def _some(
    fields: dict[str, st.SearchStrategy[Any]], most: int
) -> st.SearchStrategy[dict[str, Any]]:
    """Up to `most` of `fields`, each with a drawn value."""
    names = st.lists(st.sampled_from(sorted(fields)), max_size=most, unique=True)
    return names.flatmap(lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys}))


def tgi_parameters() -> st.SearchStrategy[dict[str, Any]]:
    fields: dict[str, st.SearchStrategy[Any]] = {name: _field(FLOATS) for name in FLOAT_FIELDS}
    fields.update({name: _field(INTS) for name in INT_FIELDS})
    fields.update({name: _field(st.booleans()) for name in BOOL_FIELDS})
    fields["stop"] = _field(st.lists(st.text(max_size=4), max_size=6))
    fields["length_penalty"] = _field(
        st.fixed_dictionaries({"start_index": INTS, "decay_factor": FLOATS})
    )
    return _some(fields, 4)


def openai_body() -> st.SearchStrategy[dict[str, Any]]:
    fields: dict[str, st.SearchStrategy[Any]] = {
        name: _field(FLOATS)
        for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty")
    }
    ints = ("seed", "n", "logprobs", "top_k", "best_of", "min_tokens")
    fields.update({name: _field(INTS) for name in ints})
    fields["echo"] = _field(st.booleans())
    fields["stop"] = _field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4))))
    prompt = st.one_of(
        st.text(min_size=1, max_size=20),
        st.lists(st.integers(0, 4095), min_size=1, max_size=6),
        st.lists(st.integers(-1, 5000), min_size=1, max_size=6),
    )
    return st.tuples(prompt, _some(fields, 4)).map(
        lambda pair: {"prompt": pair[0], "max_tokens": NEW_TOKENS, **pair[1]}
    )


@pytest.fixture(scope="module")
def client(demo_model_dir: Path) -> Iterator[TestClient]:
    with (
        demo_app(demo_model_dir, 128) as app,
        TestClient(app, raise_server_exceptions=False) as test_client,
    ):
        yield test_client


def check(response: Any) -> None:
    """422 with a message, or 200 whose JSON is strict and whose logprobs are finite."""
    assert response.status_code in (200, 422), (response.status_code, response.text)
    text = response.text
    assert "NaN" not in text and "Infinity" not in text, text
    body = json.loads(text)
    if response.status_code == 422:
        return
    numbers: list[float] = []

    def walk(value: Any) -> None:
        if isinstance(value, float):
            numbers.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(body)
    assert all(math.isfinite(n) for n in numbers)


PROPERTY = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@PROPERTY
@given(parameters=tgi_parameters(), inputs=st.text(min_size=0, max_size=30))
# Found by fuzzing: 1 / temperature underflows float32, the EOS mask (-inf) times 0 is NaN.
@example(parameters={"temperature": 1e300, "min_new_tokens": 1}, inputs="hello")
def test_any_tgi_request_is_refused_or_runs(
    client: TestClient, parameters: dict[str, Any], inputs: str
) -> None:
    parameters = {"details": True, **parameters, "max_new_tokens": NEW_TOKENS}
    body = json.dumps({"inputs": inputs, "parameters": parameters})
    check(client.post("/generate", content=body, headers={"content-type": "application/json"}))


@PROPERTY
@given(body=openai_body())
@example(body={"prompt": "hello", "max_tokens": NEW_TOKENS, "temperature": 1e300, "min_tokens": 1})
def test_any_openai_completion_is_refused_or_runs(client: TestClient, body: dict[str, Any]) -> None:
    data = json.dumps(body)
    check(
        client.post("/v1/completions", content=data, headers={"content-type": "application/json"})
    )
