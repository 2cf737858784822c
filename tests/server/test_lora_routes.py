"""LoRA adapters on every API of `tgis serve` (bundled model, one adapter named at start-up,
one in the on-demand directory): TGI's `adapter_id`, OpenAI's `model` (with the `openai`
client; /v1/models lists the adapters) and gRPC's `adapter_id` (field 4) give the greedy text
of the model with that adapter merged into its weights; unknown adapters are a 422 (or
INVALID_ARGUMENT) naming the adapters there are, and the server keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer, PreTrainedModel

from tests.factories import make_lora_adapter
from tests.server.conftest import live_server
from tgis.backends.common.device import load_causal_lm
from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas import generation_pb2_grpc as pb_grpc
from tgis.fmaas.server import GrpcServer
from tgis.hub import read_model_config
from tgis.launch import build_service, service_info
from tgis.server import Metrics, create_app

PROMPT = "def fibonacci(n):"
NEW_TOKENS = 12
NAMED, ON_DEMAND = "support", "team/coder"


@pytest.fixture(scope="module")
def expected(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The adapters on disk and the text each model gives: None is the base model's."""
    base = load_causal_lm(demo_model_dir, torch.device("cpu"), "float32")
    root = tmp_path_factory.mktemp("lora-routes")
    models: dict[str | None, PreTrainedModel] = {None: base}
    models[NAMED] = make_lora_adapter(base, root / "named", 1, r=8, lora_alpha=32)
    models[ON_DEMAND] = make_lora_adapter(
        base, root / "dir" / ON_DEMAND, 2, r=4, lora_alpha=64,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    texts: dict[str | None, str] = {}
    for name, model in models.items():
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        texts[name] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(set(texts.values())) == 3  # each adapter changes the text
    return {"root": root, "texts": texts}


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, expected: dict[str, Any]) -> Iterator[tuple[str, int, str]]:
    root: Path = expected["root"]
    facts = ModelFacts.from_config(*read_model_config(demo_model_dir))
    args = LauncherArgs(
        max_total_tokens=128, backend="cpu", dtype="float32",
        lora_adapters=f"{NAMED}={root / 'named'}", lora_adapter_dir=str(root / "dir"),
    )  # fmt: skip
    config = build_serve_config(args, facts, {"WARMUP_ENABLED": "false"})
    svc = build_service(config, demo_model_dir, observer=Metrics(128, 8))
    assert svc.adapters is not None
    app = create_app(svc.engine, svc.tokenizer, config, service_info(svc),
                     metrics=svc.engine.observer, adapters=svc.adapters)  # type: ignore[arg-type]  # fmt: skip
    grpc_server = GrpcServer(app.state.tgis, "127.0.0.1", 0, None)
    try:
        with live_server(app, companions=[grpc_server]) as (url, _):
            yield url, grpc_server.port, config.model_id
    finally:
        svc.stop()


def generate(url: str, **parameters: Any) -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, **parameters}}
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def grpc_generate(port: int, adapter_id: str | None) -> pb.BatchedGenerationResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=PROMPT)],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS)),
            **({"adapter_id": adapter_id} if adapter_id is not None else {}),
        )
        return stub.Generate(request, timeout=60)


def test_every_api_selects_the_adapter(
    server: tuple[str, int, str], expected: dict[str, Any]
) -> None:
    url, grpc_port, model_id = server
    texts = expected["texts"]
    for adapter in (NAMED, ON_DEMAND, None, ""):
        answer = generate(url, adapter_id=adapter)
        assert answer.status_code == 200, answer.text
        assert answer.json()["generated_text"] == texts[adapter or None]
    client = OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    for model in (NAMED, ON_DEMAND, model_id, "tgi"):  # "tgi": TGI's name of the base model
        completion = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0
        )
        base = model in (model_id, "tgi")
        assert completion.choices[0].text == texts[None if base else model]
        assert completion.model == (model_id if base else model)
    for adapter in (ON_DEMAND, None):
        assert grpc_generate(grpc_port, adapter).responses[0].text == texts[adapter]


def test_requests_with_different_adapters_share_steps(
    server: tuple[str, int, str], expected: dict[str, Any]
) -> None:
    url, _, _ = server
    chosen = [NAMED, None, ON_DEMAND, NAMED, None, ON_DEMAND]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            answers = await asyncio.gather(*(
                client.post(f"{url}/generate", json={
                    "inputs": PROMPT,
                    "parameters": {"max_new_tokens": NEW_TOKENS, "adapter_id": a},
                })
                for a in chosen
            ))  # fmt: skip
        return [a.json()["generated_text"] for a in answers]

    assert asyncio.run(together()) == [expected["texts"][a] for a in chosen]


def test_models_lists_the_adapters(server: tuple[str, int, str]) -> None:
    url, _, model_id = server
    client = OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    listed = client.models.list().data
    assert [m.id for m in listed] == [model_id, NAMED, ON_DEMAND]
    assert all(getattr(m, "parent", None) == model_id for m in listed[1:])


def test_unknown_adapters_are_refused_and_the_server_goes_on(
    server: tuple[str, int, str], expected: dict[str, Any]
) -> None:
    url, grpc_port, _ = server
    answer = generate(url, adapter_id="nope")
    assert answer.status_code == 422
    assert answer.json()["error"] == (
        f"Input validation error: adapter_id 'nope': no adapter 'nope' in the adapter directory (no "
        f"adapter_config.json); this server has: {NAMED}, {ON_DEMAND}"
    )
    escaping = generate(url, adapter_id="../named")
    assert escaping.status_code == 422 and "'_', '-', '.' and '/'" in escaping.json()["error"]
    completion = httpx.post(
        f"{url}/v1/completions", json={"model": "nope", "prompt": PROMPT}, timeout=60
    )
    assert completion.status_code == 422 and "adapter_id 'nope'" in completion.text
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(grpc_port, "nope")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert generate(url, adapter_id=NAMED).json()["generated_text"] == expected["texts"][NAMED]
