"""A tiny random T5 served like any model: TGI routes, OpenAI completions and TGIS's gRPC,
greedy answers equal transformers' generate, the kind reported, input details refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from tests.backends.seq2seq.test_backend import NEW_TOKENS, prefix_rows, prefixed_reference
from tests.factories import save_model, tiny_model
from tests.server.conftest import live_server
from tgis.backends.seq2seq.backend import Seq2SeqBackend
from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.errors import ConfigError
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas import generation_pb2_grpc as pb_grpc
from tgis.fmaas.server import GrpcServer
from tgis.hub import read_model_config
from tgis.launch import build_service, service_info
from tgis.server import Metrics, create_app

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_model("t5", seed=1, initializer_factor=6.0)
    return save_model(model, tmp_path_factory.mktemp("t5"))


@pytest.fixture(scope="module")
def expected_ids(model_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([tokenizer(PROMPT)["input_ids"]]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
        )
    return out[0, 1:].tolist()


@pytest.fixture(scope="module")
def prefix_store(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with one prefix for the encoder (3 rows) and the decoder (2 rows)."""
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32)
    root = tmp_path_factory.mktemp("prefixes")
    (root / "tuned").mkdir()
    torch.save(prefix_rows(model, 3, 1), root / "tuned" / "encoder.pt")
    torch.save(prefix_rows(model, 2, 2), root / "tuned" / "decoder.pt")
    return root


@pytest.fixture(scope="module")
def server(model_dir: Path, prefix_store: Path) -> Iterator[tuple[str, int]]:
    facts = ModelFacts.from_config(*read_model_config(model_dir))
    assert facts.encoder_decoder
    args = LauncherArgs(
        max_total_tokens=64, backend="cpu", dtype="float32", prefix_store_path=str(prefix_store)
    )
    config = build_serve_config(args, facts, {"WARMUP_ENABLED": "false"})
    svc = build_service(config, model_dir, observer=Metrics(64, 8))
    assert isinstance(svc.backend, Seq2SeqBackend)
    app = create_app(svc.engine, svc.tokenizer, config, service_info(svc),
                     metrics=svc.engine.observer, prefixes=svc.prefixes)  # type: ignore[arg-type]  # fmt: skip
    grpc_server = GrpcServer(app.state.tgis, "127.0.0.1", 0, None)
    try:
        with live_server(app, companions=[grpc_server]) as (url, _):
            yield url, grpc_server.port
    finally:
        svc.engine.stop()


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_tgi_routes_answer_with_generates_tokens(
    server: tuple[str, int], expected_ids: list[int]
) -> None:
    url, _ = server
    parameters = {"max_new_tokens": NEW_TOKENS, "details": True, "ignore_eos": True}
    body = post(url, "/generate", {"inputs": PROMPT, "parameters": parameters}).json()
    assert [t["id"] for t in body["details"]["tokens"]] == expected_ids
    assert body["details"]["prefill"] == []
    with httpx.stream(
        "POST", f"{url}/generate_stream", json={"inputs": PROMPT, "parameters": parameters},
        timeout=60,
    ) as stream:  # fmt: skip
        events = [line for line in stream.iter_lines() if line.startswith("data:")]
    assert len(events) == NEW_TOKENS


def test_sampling_and_openai_completions_work(server: tuple[str, int]) -> None:
    url, _ = server
    sampled = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "do_sample": True, "seed": 4}}
    first, again = post(url, "/generate", sampled).json(), post(url, "/generate", sampled).json()
    assert first == again
    completion = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] >= 1


def test_what_encoder_decoder_models_refuse(server: tuple[str, int]) -> None:
    url, grpc_port = server
    details = {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}
    refused = post(url, "/generate", details)
    assert refused.status_code == 422
    assert "not available for encoder-decoder models" in refused.json()["error"]
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 422 and "chat template" in chat.text
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        asked = pb.ResponseOptions(input_tokens=True, token_logprobs=True)
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=PROMPT)], params=pb.Parameters(response=asked)
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not available for encoder-decoder models" in info.value.details()


def test_the_kind_is_reported_and_grpc_generates(
    server: tuple[str, int], expected_ids: list[int], model_dir: Path
) -> None:
    url, grpc_port = server
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert info["model_kind"] == "encoder_decoder"
    assert info["model_pipeline_tag"] == "text2text-generation"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        model = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert model.model_kind == pb.ModelInfoResponse.ENCODER_DECODER
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=PROMPT)] * 3,
            params=pb.Parameters(
                stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS),
                response=pb.ResponseOptions(generated_tokens=True),
            ),
        )
        responses = stub.Generate(request, timeout=60).responses
    expected = tokenizer.convert_ids_to_tokens(expected_ids)
    for response in responses:  # greedy: each input of the batch alike
        got = [t.text for t in response.tokens]
        assert got == expected[: len(got)]  # the same tokens, up to an EOS
        assert response.stop_reason in (pb.MAX_TOKENS, pb.EOS_TOKEN)


@pytest.mark.parametrize("backend", ["tpu", "neuron", "gaudi"])
def test_static_backends_refuse_encoder_decoder_models(backend: str) -> None:
    facts = ModelFacts("t5", None, None, encoder_decoder=True)
    env = {"HF_BATCH_SIZE": "1", "HF_SEQUENCE_LENGTH": "128"}
    with pytest.raises(ConfigError) as info:
        build_serve_config(LauncherArgs(backend=backend), facts, env)
    assert "is an encoder-decoder model" in str(info.value)
    assert "--backend cpu or cuda" in str(info.value)


def test_a_prompt_prefix_goes_before_the_encoders_and_the_decoders_inputs(
    server: tuple[str, int], model_dir: Path, prefix_store: Path, expected_ids: list[int]
) -> None:
    url, _ = server
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoder = torch.load(prefix_store / "tuned" / "encoder.pt", weights_only=True)
    decoder = torch.load(prefix_store / "tuned" / "decoder.pt", weights_only=True)
    ids = tuple(tokenizer(PROMPT)["input_ids"])
    expected = prefixed_reference(model, ids, encoder, decoder)
    assert expected != expected_ids
    parameters = {"max_new_tokens": NEW_TOKENS, "details": True, "ignore_eos": True}
    body = post(
        url, "/generate", {"inputs": PROMPT, "parameters": {**parameters, "prefix_id": "tuned"}}
    ).json()
    assert [t["id"] for t in body["details"]["tokens"]] == expected


def test_generation_parameters_apply_to_encoder_decoder_models(
    server: tuple[str, int], expected_ids: list[int]
) -> None:
    url, _ = server
    parameters = {
        "max_new_tokens": 6,
        "min_new_tokens": 6,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "truncate": 4,
        "top_n_tokens": 3,
        "details": True,
        "decoder_input_details": False,
    }
    body = post(url, "/generate", {"inputs": PROMPT, "parameters": parameters})
    assert body.status_code == 200, body.text
    details = body.json()["details"]
    assert details["generated_tokens"] == 6 and details["finish_reason"] == "length"
    assert all(len(t) >= 3 for t in details["top_tokens"])
    assert all(t["logprob"] <= 0 for t in details["tokens"])
    # A stop sequence cut from the greedy answer ends it there.
    greedy = post(
        url, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS}}
    ).json()["generated_text"]
    assert len(greedy) > 4
    stop = greedy[2:4]
    stopped = post(
        url,
        "/generate",
        {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "stop": [stop],
                                          "details": True}},
    ).json()  # fmt: skip
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert stopped["generated_text"] == greedy[: greedy.index(stop) + len(stop)]
