"""fmaas.GenerationService over the real engine (the bundled model), through a gRPC channel."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import live_server
from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas import generation_pb2_grpc as pb_grpc
from tgis.fmaas.server import GrpcServer
from tgis.hub import read_model_config
from tgis.launch import Service, build_service
from tgis.server import Metrics, ModelInfo, create_app

MAX_CONCURRENT = 4
PROMPTS = ["def fibonacci(n):", "import os", "class Tree:\n    def __init__(self, left, right):"]


@pytest.fixture(scope="module")
def service(demo_model_dir: Path) -> Iterator[Service]:
    facts = ModelFacts.from_config(*read_model_config(demo_model_dir))
    args = LauncherArgs(
        max_sequence_length=200,
        max_new_tokens=169,
        max_concurrent_requests=MAX_CONCURRENT,
        backend="cpu",
        dtype_str="float32",
    )
    config = build_serve_config(args, facts, {"WARMUP_ENABLED": "false"})
    svc = build_service(config, demo_model_dir, observer=Metrics(config.max_total_tokens, 8))
    yield svc
    svc.engine.stop()


@pytest.fixture(scope="module")
def server(service: Service) -> Iterator[tuple[Any, str, GrpcServer]]:
    """(the app's state, the HTTP URL, the gRPC server) of one live server."""
    info = ModelInfo.from_config(service.config, max_batch_total_tokens=service.kv_tokens)
    metrics: Metrics = service.engine.observer  # type: ignore[assignment]
    app = create_app(service.engine, service.tokenizer, service.config, info, metrics=metrics)
    grpc_server = GrpcServer(app.state.tgis, "127.0.0.1", 0, None)
    with live_server(app, companions=[grpc_server]) as (url, _):
        yield app.state.tgis, url, grpc_server


@pytest.fixture
def channel(server: tuple[Any, str, GrpcServer]) -> Iterator[grpc.Channel]:
    state, _, grpc_server = server
    with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as ch:
        yield ch
    wait_idle(state)


@pytest.fixture
def stub(channel: grpc.Channel) -> pb_grpc.GenerationServiceStub:
    return pb_grpc.GenerationServiceStub(channel)


def wait_idle(state: Any, timeout: float = 20.0) -> None:
    """Every request of a test has left the engine (cancelled ones at their next step)."""
    deadline = time.monotonic() + timeout
    while state.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert state.engine.in_flight == 0


def batch(*texts: str, **parts: Any) -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=t) for t in texts], params=pb.Parameters(**parts)
    )


def stopping(n: int, **kw: Any) -> pb.StoppingCriteria:
    return pb.StoppingCriteria(max_new_tokens=n, **kw)


def metric(url: str, name: str, **labels: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_a_batch_answers_each_input_in_order_as_alone(stub: pb_grpc.GenerationServiceStub) -> None:
    together = stub.Generate(batch(*PROMPTS, stopping=stopping(12)), timeout=60).responses
    alone = [
        stub.Generate(batch(p, stopping=stopping(12)), timeout=60).responses[0] for p in PROMPTS
    ]
    assert [r.text for r in together] == [r.text for r in alone]
    assert all(r.text for r in together) and len({r.text for r in together}) == 3
    assert [r.input_token_count for r in together] == [r.input_token_count for r in alone]
    assert all(r.stop_reason in (pb.MAX_TOKENS, pb.EOS_TOKEN) for r in together)
    assert all(r.seed == 0 for r in together)  # greedy: no seed


def test_the_stream_is_the_unary_answer_in_tgis_messages(
    stub: pb_grpc.GenerationServiceStub,
) -> None:
    options = pb.ResponseOptions(
        input_text=True, generated_tokens=True, input_tokens=True, token_logprobs=True,
        token_ranks=True, top_n_tokens=2,
    )  # fmt: skip
    params = {"stopping": stopping(10), "response": options}
    unary = stub.Generate(batch(PROMPTS[0], **params), timeout=60).responses[0]
    single = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=PROMPTS[0]), params=pb.Parameters(**params)
    )
    messages = list(stub.GenerateStream(single, timeout=60))
    first, inputs, rest = messages[0], messages[1], messages[2:]
    assert first.input_token_count == unary.input_token_count and first.text == PROMPTS[0]
    assert first.generated_token_count == 0 and first.stop_reason == pb.NOT_FINISHED
    assert len(inputs.input_tokens) == unary.input_token_count
    assert [t.text for t in inputs.input_tokens] == [t.text for t in unary.input_tokens]
    counts = [m.generated_token_count for m in rest]
    assert counts == sorted(set(counts)) and counts[-1] == unary.generated_token_count
    assert all(m.stop_reason == pb.NOT_FINISHED for m in rest[:-1])
    assert rest[-1].stop_reason == unary.stop_reason
    assert PROMPTS[0] + "".join(m.text for m in rest) == unary.text
    streamed = [t for m in rest for t in m.tokens]
    assert [t.text for t in streamed] == [t.text for t in unary.tokens]
    assert [t.rank for t in streamed] == [t.rank for t in unary.tokens]
    for a, b in zip(streamed, unary.tokens, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert len(a.top_tokens) == len(b.top_tokens) >= 2
    # Input tokens: the first has no prediction (logprob NaN, rank 0), the others do.
    head, *tail = unary.input_tokens
    assert math.isnan(head.logprob) and head.rank == 0 and not head.top_tokens
    assert all(t.rank >= 1 and t.logprob <= 0 and len(t.top_tokens) == 2 for t in tail)
    # Greedy tokens rank first in the distribution they were chosen from.
    assert all(t.rank == 1 for t in unary.tokens)


def test_input_tokens_without_detail_are_the_token_strings_only(
    stub: pb_grpc.GenerationServiceStub, service: Service
) -> None:
    options = pb.ResponseOptions(input_tokens=True)
    request = batch("import os", stopping=stopping(2), response=options)
    response = stub.Generate(request).responses[0]
    pieces = service.tokenizer.convert_ids_to_tokens(service.tokenizer.encode("import os"))
    assert [t.text for t in response.input_tokens] == pieces  # as Tokenize gives them
    assert all(t.logprob == 0 and t.rank == 0 for t in response.input_tokens)


def test_sampling_returns_its_seed_and_replays_with_it(stub: pb_grpc.GenerationServiceStub) -> None:
    sampling = {"method": pb.SAMPLE, "stopping": stopping(12)}
    first = stub.Generate(batch(PROMPTS[1], **sampling), timeout=60).responses[0]
    assert 0 < first.seed < 2**32
    seeded = pb.SamplingParameters(seed=first.seed)
    again = stub.Generate(batch(PROMPTS[1], **sampling, sampling=seeded), timeout=60).responses[0]
    assert again.text == first.text and again.seed == first.seed


def test_max_new_tokens_is_cut_to_the_sequence_length_and_ends_with_token_limit(
    stub: pb_grpc.GenerationServiceStub, service: Service
) -> None:
    words = " ".join(["x"] * 400)
    ids = service.tokenizer.encode(words)
    truncate = 195
    assert len(ids) > truncate
    response = stub.Generate(
        batch(words, stopping=stopping(100), truncate_input_tokens=truncate), timeout=60
    ).responses[0]
    assert response.input_token_count == truncate
    if response.stop_reason != pb.EOS_TOKEN:
        assert response.stop_reason == pb.TOKEN_LIMIT and response.generated_token_count == 5


def test_a_length_penalty_makes_the_sequence_end(stub: pb_grpc.GenerationServiceStub) -> None:
    plain = stub.Generate(batch(PROMPTS[0], stopping=stopping(40)), timeout=60).responses[0]
    assert plain.stop_reason == pb.MAX_TOKENS
    penalty = pb.DecodingParameters.LengthPenalty(start_index=2, decay_factor=10.0)
    ended = stub.Generate(
        batch(PROMPTS[0], stopping=stopping(40),
              decoding=pb.DecodingParameters(length_penalty=penalty)),
        timeout=60,
    ).responses[0]  # fmt: skip
    assert ended.stop_reason == pb.EOS_TOKEN and ended.generated_token_count < 40


def test_stop_sequences_keep_or_cut_their_text(stub: pb_grpc.GenerationServiceStub) -> None:
    plain = stub.Generate(batch(PROMPTS[0], stopping=stopping(30)), timeout=60).responses[0]
    stop = plain.text[5:8]
    assert stop and len(plain.text) > 8
    for include in (True, False):
        criteria = stopping(30, stop_sequences=[stop], include_stop_sequence=include)
        got = stub.Generate(batch(PROMPTS[0], stopping=criteria), timeout=60).responses[0]
        assert got.stop_reason == pb.STOP_SEQUENCE and got.stop_sequence == stop
        end = plain.text.index(stop) + (len(stop) if include else 0)
        assert got.text == plain.text[:end]


def test_a_time_limit_counts_from_arrival(stub: pb_grpc.GenerationServiceStub) -> None:
    criteria = stopping(150, time_limit_millis=1)
    response = stub.Generate(batch(PROMPTS[0], stopping=criteria), timeout=60).responses[0]
    assert response.stop_reason == pb.TIME_LIMIT and response.generated_token_count == 1


def test_a_batch_over_the_concurrency_limit_is_refused_whole(
    stub: pb_grpc.GenerationServiceStub, server: tuple[Any, str, GrpcServer]
) -> None:
    state, url, _ = server
    before = metric(url, "tgi_request_failure_total", err="conc_limit")
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(batch(*["import os"] * (MAX_CONCURRENT + 1), stopping=stopping(2)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "Model is overloaded"
    assert state.engine.in_flight == 0  # nothing was admitted
    assert metric(url, "tgi_request_failure_total", err="conc_limit") == before + 1
    full = stub.Generate(batch(*["import os"] * MAX_CONCURRENT, stopping=stopping(2)), timeout=60)
    assert len(full.responses) == MAX_CONCURRENT


def test_a_cancelled_stream_frees_its_place(
    stub: pb_grpc.GenerationServiceStub, server: tuple[Any, str, GrpcServer]
) -> None:
    state, url, _ = server
    before = metric(url, "tgi_request_failure_total", err="cancelled")
    single = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=PROMPTS[0]), params=pb.Parameters(stopping=stopping(160))
    )
    call = stub.GenerateStream(single, timeout=60)
    received = [next(call) for _ in range(3)]
    assert received[-1].generated_token_count >= 1
    assert state.engine.in_flight == 1
    # The engine's loop is held between two steps while the client cancels, so that the
    # stream cannot run to its end first (on a busy machine the client reads slowly).
    paused, resume = threading.Event(), threading.Event()

    def hold() -> None:
        paused.set()
        resume.wait(60)

    holder = threading.Thread(target=state.engine.call, args=(hold,), daemon=True)
    holder.start()
    try:
        assert paused.wait(30)
        call.cancel()
        deadline = time.monotonic() + 30  # a bound on a hang, not a measure
        while metric(url, "tgi_request_failure_total", err="cancelled") < before + 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        resume.set()
        holder.join(30)
    wait_idle(state)


def test_a_stream_closed_at_a_message_counts_as_cancelled(
    server: tuple[Any, str, GrpcServer],
) -> None:
    """grpc cancels a call whose stream is sending a message by closing the stream where it
    yielded, not by raising in it: that is a cancellation too, and frees the place."""
    state, url, grpc_server = server
    before = metric(url, "tgi_request_failure_total", err="cancelled")
    single = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=PROMPTS[0]), params=pb.Parameters(stopping=stopping(160))
    )

    async def take_three_then_close() -> list[pb.GenerationResponse]:
        stream = grpc_server.service.GenerateStream(single, None)  # type: ignore[arg-type]
        received = [await anext(stream) for _ in range(3)]
        await stream.aclose()
        return received

    received = asyncio.run(take_three_then_close())
    assert received[-1].generated_token_count >= 1
    assert metric(url, "tgi_request_failure_total", err="cancelled") == before + 1
    wait_idle(state)


def test_validation_and_missing_request_statuses(stub: pb_grpc.GenerationServiceStub) -> None:
    cases = [
        (
            lambda: stub.Generate(
                batch("x", method=pb.SAMPLE, sampling=pb.SamplingParameters(temperature=0.01))
            ),
            "temperature must be >= 0.05",
        ),
        (
            lambda: list(stub.GenerateStream(pb.SingleGenerationRequest())),
            "missing request",
        ),
        (
            lambda: stub.Generate(batch(" ".join(["x"] * 400), stopping=stopping(5))),
            None,  # the message names the input's length
        ),
        (
            lambda: stub.Generate(
                pb.BatchedGenerationRequest(
                    prefix_id="tuned", requests=[pb.GenerationRequest(text="x")]
                )
            ),
            "can't retrieve prompt prefix with id 'tuned': this server has no prompt prefix store (start it with --prefix-store-path)",
        ),
    ]
    for call, message in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        if message is None:
            assert info.value.details().endswith("plus prefix length (0) must be < 200")
        else:
            assert info.value.details() == message


def test_an_empty_batch_is_an_empty_answer(stub: pb_grpc.GenerationServiceStub) -> None:
    assert stub.Generate(pb.BatchedGenerationRequest()) == pb.BatchedGenerationResponse()


def test_tokenize_counts_tokens_and_offsets_after_left_truncation(
    stub: pb_grpc.GenerationServiceStub, service: Service
) -> None:
    text = "def fibonacci(n): return n"
    ids = service.tokenizer.encode(text)
    full = stub.Tokenize(
        pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text=text)], return_tokens=True, return_offsets=True
        )
    ).responses[0]
    assert full.token_count == len(ids)
    assert list(full.tokens) == service.tokenizer.convert_ids_to_tokens(ids)
    spans = [(o.start, o.end) for o in full.offsets]
    assert spans[-1][1] == len(text.encode())
    cut = stub.Tokenize(
        pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text=text)] * 2, return_offsets=True,
            truncate_input_tokens=3,
        )
    )  # fmt: skip
    assert [r.token_count for r in cut.responses] == [3, 3]
    assert [(o.start, o.end) for o in cut.responses[0].offsets] == spans[-3:]
    assert not cut.responses[0].tokens  # not asked


def test_model_info_health_and_reflection(
    channel: grpc.Channel, stub: pb_grpc.GenerationServiceStub
) -> None:
    info = stub.ModelInfo(pb.ModelInfoRequest(model_id="ignored"))
    assert info.model_kind == pb.ModelInfoResponse.DECODER_ONLY
    assert (info.max_sequence_length, info.max_new_tokens) == (200, 169)
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "fmaas.GenerationService"):
        status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert "fmaas.GenerationService" in names


def test_requests_are_counted_by_kind_and_stop_reason(
    stub: pb_grpc.GenerationServiceStub, server: tuple[Any, str, GrpcServer]
) -> None:
    _, url, _ = server
    labels = {"kind": "batch", "stop_reason": "MAX_TOKENS"}
    before = metric(url, "tgi_request_count_total", kind="batch")
    succeeded = metric(url, "tgi_request_success_total", **labels)
    stub.Generate(batch("import os", "import sys", stopping=stopping(2)), timeout=60)
    assert metric(url, "tgi_request_count_total", kind="batch") == before + 1
    assert metric(url, "tgi_request_success_total", **labels) == succeeded + 2


def test_a_draining_server_refuses_new_calls(
    stub: pb_grpc.GenerationServiceStub, server: tuple[Any, str, GrpcServer]
) -> None:
    state = server[0]
    state.lifecycle.draining = True
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(batch("x"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        state.lifecycle.draining = False


def test_concurrent_streams_and_batches_share_the_engine(
    stub: pb_grpc.GenerationServiceStub,
) -> None:
    """Two streams and a batch at once: each answer is what it is alone."""
    alone = {
        p: stub.Generate(batch(p, stopping=stopping(8)), timeout=60).responses[0].text
        for p in PROMPTS[:2]
    }
    results: dict[str, str] = {}

    def stream(prompt: str) -> None:
        single = pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=prompt), params=pb.Parameters(stopping=stopping(8))
        )
        results[prompt] = "".join(m.text for m in stub.GenerateStream(single, timeout=60))

    threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS[:2]]
    for t in threads:
        t.start()
    both = stub.Generate(batch(*PROMPTS[:2], stopping=stopping(8)), timeout=60).responses
    for t in threads:
        t.join(60)
    assert results == alone
    assert [r.text for r in both] == [alone[p] for p in PROMPTS[:2]]
