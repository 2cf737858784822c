"""The API's request schemas are the server's contract: /openapi.json publishes the objects the
server checks bodies against, built from its limits; a body they forbid is a 422 that names the
field and the rule."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from tgis.params import RequestLimits
from tgis.server.http.app import api_contract
from tgis.server.http.contract import RequestContract
from tgis.server.http.errors import ApiError
from tgis.server.http.openapi_schemas import RequestSchemas

LIMITS = RequestLimits(
    max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=100,
    max_total_tokens=128, max_new_tokens=None,
)  # fmt: skip


def contract(**kw: Any) -> RequestContract:
    values: dict[str, Any] = {
        "limits": LIMITS, "max_client_batch_size": 4, "vocab_size": 1000, "prefixes": False,
    }  # fmt: skip
    return api_contract(RequestSchemas(**{**values, **kw}))


def refusal(c: RequestContract, name: str, body: Any) -> str:
    with pytest.raises(ApiError) as caught:
        c.check(name, body)
    assert caught.value.status == 422
    prefix = "Input validation error: "
    assert caught.value.message.startswith(prefix)
    return caught.value.message.removeprefix(prefix)


def test_the_served_document_carries_the_checked_schemas(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    state_contract = client.app.state.tgis.contract  # type: ignore[attr-defined]
    for name in ("GenerateParameters", "GenerateRequest", "ChatRequest", "CompletionRequest"):
        assert document["components"]["schemas"][name] == state_contract.components[name]
    # The server's limits are in it.
    params = document["components"]["schemas"]["GenerateParameters"]["properties"]
    assert params["best_of"]["maximum"] == 2
    assert params["stop"]["maxItems"] == 4
    assert params["max_new_tokens"]["maximum"] == 127


def test_valid_bodies_pass() -> None:
    c = contract()
    c.check("GenerateRequest", {"inputs": "x", "parameters": {"temperature": 0.5, "stop": []}})
    c.check("GenerateRequest", {"inputs": "x", "parameters": None})
    c.check("CompatGenerateRequest", {"inputs": "x", "stream": True, "parameters": {"best_of": 1}})
    c.check("CompletionRequest", {"prompt": [[1, 2], [3]], "n": 2, "best_of": 2})
    c.check("ChatRequest", {"messages": [{"role": "user", "content": None}], "stream": True,
                            "stream_options": {"include_usage": True}})  # fmt: skip


def test_bounds_name_the_field_and_the_limit() -> None:
    c = contract()
    message = refusal(c, "GenerateRequest", {"inputs": "x", "parameters": {"top_k": 2**63}})
    assert message == f"`parameters.top_k` must be <= {2**63 - 1}. Given: {2**63}"
    message = refusal(c, "GenerateRequest", {"inputs": "x", "parameters": {"temperature": 1e5}})
    assert "`parameters.temperature` must be <= 10000.0" in message
    message = refusal(c, "CompletionRequest", {"prompt": [5, 1000]})
    assert "`prompt`" in message
    message = refusal(c, "ChatRequest", {"messages": []})
    assert message == "`messages` must have at least 1 item(s)"
    message = refusal(c, "CompletionRequest", {"prompt": "x", "model": 5})
    assert message.startswith("`model`: 5 is not of type")


def test_rules_between_fields_say_the_rule() -> None:
    c = contract()
    body = {"inputs": "x", "parameters": {"best_of": 2, "seed": 3, "do_sample": True}}
    assert "`best_of` > 1 needs sampling" in refusal(c, "GenerateRequest", body)
    body = {"inputs": "x", "parameters": {"best_of": 2}}
    assert "`best_of` > 1 needs sampling" in refusal(c, "GenerateRequest", body)
    body = {"inputs": "x", "stream": True, "parameters": {"decoder_input_details": True}}
    assert "a streamed request takes neither" in refusal(c, "CompatGenerateRequest", body)
    body = {"prompt": "x", "stream_options": {"include_usage": True}}
    assert refusal(c, "CompletionRequest", body) == (
        "`stream_options` is only allowed when `stream` is true"
    )
    assert "equal to `n`" in refusal(c, "CompletionRequest", {"prompt": "x", "best_of": 2})


def test_what_the_server_lacks_is_refused_with_its_reason() -> None:
    c = contract(no_prompt_logprobs="no prompt logprobs on the neuron backend")
    body = {"inputs": "x", "parameters": {"decoder_input_details": True}}
    assert refusal(c, "GenerateRequest", body) == "no prompt logprobs on the neuron backend"
    body = {"inputs": "x", "parameters": {"prefix_id": "tuned"}}
    assert "`parameters.prefix_id`" in refusal(c, "GenerateRequest", body)
    contract(prefixes=True).check("GenerateRequest", body)
