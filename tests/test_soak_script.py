"""scripts/soak.py (`make soak`) in a few seconds: a real `tgis serve` with 2 places and 4
clients answers every request (ok, 429 or a stream the client cut), none lost or hung; and the
script's classes of outcome on answers made up to be complete, cut short or wrong."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
assert _spec is not None and _spec.loader is not None
soak = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("soak", soak)  # dataclasses look their module up by name
_spec.loader.exec_module(soak)


def test_short_soak_loses_nothing(tmp_path: Path) -> None:
    output = tmp_path / "soak.json"
    code = soak.main(
        [
            "--duration", "6",
            "--max-concurrent-requests", "2",
            "--concurrency", "4",
            "--disconnect-fraction", "0.5",
            "--server-log", str(tmp_path / "serve.log"),
            "--output", str(output),
        ]
    )  # fmt: skip
    summary = json.loads(output.read_text())
    counts = summary["counts"]
    assert counts["ok"] > 0 and counts["overloaded"] > 0, counts
    assert counts["lost"] == 0, summary["lost_examples"]
    assert counts["hung"] == 0, summary["hung_examples"]
    assert sum(counts.values()) == summary["requests"]
    assert (summary["concurrency"], summary["server_max_concurrent_requests"]) == (4, 2)
    assert summary["gauges_after"] == {"tgi_queue_size": 0, "tgi_batch_current_size": 0}
    assert summary["health_after"] == 200
    assert summary["capacity_after"]["ok"] == 2
    assert summary["server_alive_after"]
    assert summary["shutdown"]["exit_code"] == 0 and not summary["shutdown"]["killed"]
    assert summary["passed"] and code == 0, summary["failures"]


TGI_TOKEN = 'data:{"index":1,"token":{"id":5,"text":"x"},"generated_text":null,"details":null}\n\n'
TGI_FINAL = (
    'data:{"index":2,"token":{"id":6,"text":"y"},"generated_text":"xy",'
    '"details":{"finish_reason":"length","generated_tokens":2}}\n\n'
)
TGI_JSON = '{"generated_text":"xy","details":{"finish_reason":"length"}}'
OAI_CHUNK = 'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
OAI_LAST = 'data: {"choices":[{"index":0,"text":"y","finish_reason":"length"}]}\n\n'
OAI_DONE = "data: [DONE]\n\n"
OVERLOADED_TGI = '{"error":"Model is overloaded","error_type":"overloaded"}'
OVERLOADED_OAI = '{"error":{"message":"Model is overloaded","type":"overloaded","code":429}}'


@pytest.mark.parametrize(
    ("kind", "status", "body", "cut_after", "expected"),
    [
        ("generate_stream", 200, TGI_TOKEN + TGI_FINAL, None, "ok"),
        ("generate_stream", 200, TGI_TOKEN, None, "lost"),  # ended before the final event
        ("generate_stream", 200, TGI_TOKEN + 'data:{"error":"boom"}\n\n', None, "lost"),
        ("generate_stream", 200, TGI_TOKEN + TGI_TOKEN + TGI_FINAL, 1, "disconnected"),
        ("generate_stream", 200, TGI_FINAL, 1, "ok"),  # complete before the planned cut
        ("completions_stream", 200, OAI_CHUNK + OAI_LAST + OAI_DONE, None, "ok"),
        ("completions_stream", 200, OAI_CHUNK + OAI_LAST, None, "lost"),  # no [DONE]
        ("completions_stream", 200, OAI_CHUNK + OAI_DONE, None, "lost"),  # no finish_reason
        ("generate", 200, TGI_JSON, None, "ok"),
        ("generate", 200, '{"generated_text":"xy"', None, "lost"),  # cut short
        ("generate", 429, OVERLOADED_TGI, None, "overloaded"),
        ("generate", 429, "Too Many Requests", None, "lost"),
        ("completions", 429, OVERLOADED_OAI, None, "overloaded"),
        ("chat", 503, '{"error":"Server is shutting down"}', None, "lost"),
    ],
)
def test_outcome_classes(
    kind: str, status: int, body: str, cut_after: int | None, expected: str
) -> None:
    paths = {"generate": "/generate", "generate_stream": "/generate_stream"}
    path = paths.get(kind, "/v1/chat/completions" if kind == "chat" else "/v1/completions")
    plan = soak.Plan(kind, path, {}, cut_after)
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body.encode()))

    async def run() -> str:
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as client:
            return (await soak.send(client, plan))[0]

    assert asyncio.run(run()) == expected
