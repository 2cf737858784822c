"""What the tests of sharded serving share: the prompts, and one device's answers to them."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.server.conftest import live_server
from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.hub import read_model_config
from tgis.launch import build_service, service_info
from tgis.server import Metrics, create_app

PROMPTS = ["def fibonacci(n):", "import os", "class Tree:"]
PARAMETERS = {"max_new_tokens": 12, "ignore_eos": True}


def one_shard_answers(model_dir: Path) -> list[str]:
    """The greedy answers to PROMPTS of the sharded tests' server settings on one device, served
    in process."""
    facts = ModelFacts.from_config(*read_model_config(model_dir))
    args = LauncherArgs(max_total_tokens=256, backend="cpu", dtype="float32")
    config = build_serve_config(args, facts, {"WARMUP_ENABLED": "false"})
    svc = build_service(config, model_dir, observer=Metrics(256, 8))
    app = create_app(svc.engine, svc.tokenizer, config, service_info(svc))
    try:
        with live_server(app) as (url, _):
            return [
                httpx.post(
                    f"{url}/generate", json={"inputs": p, "parameters": PARAMETERS}, timeout=60
                ).json()["generated_text"]
                for p in PROMPTS
            ]
    finally:
        svc.stop()
