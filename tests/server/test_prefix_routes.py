"""`prefix_id` on every API of `tgis serve` (bundled model, a prefix store on disk): the TGI
routes, OpenAI completions and TGIS's gRPC give the same prefixed text, which is
transformers' greedy continuation of [prefix embeddings; input embeddings]."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.test_prompt_prefix import NEW_TOKENS, reference
from tests.server.conftest import live_server
from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.engine.types import GenerationRequest, PromptPrefix
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas import generation_pb2_grpc as pb_grpc
from tgis.fmaas.server import GrpcServer
from tgis.hub import read_model_config
from tgis.launch import Service, build_service
from tgis.params import GenerateParameters
from tgis.server import Metrics, ModelInfo, create_app

PROMPT = "def fibonacci(n):"
PREFIX_ID = "team/tuned"


@pytest.fixture(scope="module")
def prefix_tensor(demo_model_dir: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    embed = model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(3)
    return torch.randn(6, embed.shape[1], generator=generator) * embed.std().item()


@pytest.fixture(scope="module")
def expected_text(demo_model_dir: Path, prefix_tensor: torch.Tensor) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    ids = tuple(tokenizer(PROMPT)["input_ids"])
    prefix = PromptPrefix(PREFIX_ID, prefix_tensor, b"")
    request = GenerationRequest("r", ids, GenerateParameters(), prefix=prefix)
    return tokenizer.decode(reference(model, request), skip_special_tokens=True)


@pytest.fixture(scope="module")
def server(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, prefix_tensor: torch.Tensor
) -> Iterator[tuple[str, int]]:
    root = tmp_path_factory.mktemp("prefixes")
    (root / PREFIX_ID).mkdir(parents=True)
    torch.save(prefix_tensor, root / PREFIX_ID / "decoder.pt")
    facts = ModelFacts.from_config(*read_model_config(demo_model_dir))
    args = LauncherArgs(
        max_total_tokens=64, backend="cpu", dtype="float32", prefix_store_path=str(root)
    )
    config = build_serve_config(args, facts, {"WARMUP_ENABLED": "false"})
    svc: Service = build_service(config, demo_model_dir, observer=Metrics(64, 8))
    assert svc.prefixes is not None
    info = ModelInfo.from_config(config, max_batch_total_tokens=svc.kv_tokens)
    app = create_app(svc.engine, svc.tokenizer, config, info, metrics=svc.engine.observer,  # type: ignore[arg-type]
                     prefixes=svc.prefixes)  # fmt: skip
    grpc_server = GrpcServer(app.state.tgis, "127.0.0.1", 0, None)
    try:
        with live_server(app, companions=[grpc_server]) as (url, _):
            yield url, grpc_server.port
    finally:
        svc.engine.stop()


def generate(url: str, **parameters: Any) -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, **parameters}}
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def test_every_api_gives_the_prefixed_continuation(
    server: tuple[str, int], expected_text: str
) -> None:
    url, grpc_port = server
    tgi = generate(url, prefix_id=PREFIX_ID)
    assert tgi.status_code == 200, tgi.text
    assert tgi.json()["generated_text"] == expected_text
    assert generate(url).json()["generated_text"] != expected_text  # the prefix matters
    completion = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "prefix_id": PREFIX_ID},
        timeout=60,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == expected_text
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.BatchedGenerationRequest(
            prefix_id=PREFIX_ID,
            requests=[pb.GenerationRequest(text=PROMPT)],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS)),
        )
        assert stub.Generate(request, timeout=60).responses[0].text == expected_text


def test_prefix_length_counts_toward_the_limits(server: tuple[str, int]) -> None:
    url, grpc_port = server
    # 64 tokens in all: the prompt's 9 and the prefix's 6 leave 49 new tokens at most.
    assert generate(url, max_new_tokens=49, prefix_id=PREFIX_ID).status_code == 200
    refused = generate(url, max_new_tokens=50, prefix_id=PREFIX_ID)
    assert refused.status_code == 422
    assert "Given: 15 `inputs` tokens and 50 `max_new_tokens`" in refused.json()["error"]
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        long = pb.BatchedGenerationRequest(
            prefix_id=PREFIX_ID,
            requests=[pb.GenerationRequest(text=" ".join(["x"] * 80))],
            params=pb.Parameters(truncate_input_tokens=58),
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(long, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "input tokens (58) plus prefix length (6) must be < 64"


@pytest.mark.parametrize(
    ("prefix_id", "reason"),
    [
        ("unknown", "no directory 'unknown' in the prefix store"),
        ("../secrets", "a prefix id is letters, digits, '_', '-' and '/', without '..'"),
    ],
)
def test_unknown_and_escaping_ids_are_422_with_tgis_message(
    server: tuple[str, int], prefix_id: str, reason: str
) -> None:
    url, _ = server
    response = generate(url, prefix_id=prefix_id)
    assert response.status_code == 422
    message = f"can't retrieve prompt prefix with id '{prefix_id}': {reason}"
    assert response.json()["error"] == f"Input validation error: {message}"  # TGI's 422 form
