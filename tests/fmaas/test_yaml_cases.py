"""TGIS-format YAML integration cases against a real `tgis serve` process over gRPC.

The cases (tests/fmaas/cases/demo_model.yaml) are in the format of TGIS's own integration
tests: a list of `name`, `request` (a BatchedGenerationRequest, or with `request_type:
tokenize` a BatchedTokenizeRequest, in protobuf JSON), and either `response` (the expected
response as `json_format.MessageToDict` renders it) or `error` (`code`: the gRPC status code's
name, `message`: its exact details); `skip_check: true` only checks that the call succeeds
(and, when a response is given, its input token counts). Floats compare approximately.

Each case runs through Generate (or Tokenize) as `test_unary[<name>]`; each single-input
generate case runs through GenerateStream too, as `test_stream[<name>]`, its messages joined
and checked against the same expectation.

The server is `tgis serve` on the bundled demo model, with TGIS's test limits (sequence
length 200, max_new_tokens 169, batch 8), float32 on the cpu backend, started once for the
module.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf import json_format

from tgis.config import DEMO_MODEL
from tgis.config.env import ALIASES, ENV_NAMES
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas import generation_pb2_grpc as pb_grpc

CASES_FILE = Path(__file__).resolve().parent / "cases" / "demo_model.yaml"
ROOT = Path(__file__).resolve().parents[2]

MAX_SEQUENCE_LENGTH = 200
MAX_NEW_TOKENS = 169
STARTUP_TIMEOUT_S = 120
CALL_TIMEOUT_S = 60
# TGIS's tolerances for floats (logprobs).
REL, ABS = 5e-4, 1e-9

CASE_KEYS = {"name", "request", "request_type", "response", "error", "skip_check"}
CASE_KEYS |= {"singleShardOnly"}  # TGIS's files mark prompt-prefix cases so; one shard here


# --- the cases ------------------------------------------------------------------------------


def load_cases(path: Path) -> list[dict[str, Any]]:
    """The file's cases, checked for the format's shape (a typo fails loudly here)."""
    cases = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(cases, list):
        raise ValueError(f"{path}: a YAML list of cases expected")
    names: set[str] = set()
    for index, case in enumerate(cases):
        if not isinstance(case, dict) or not isinstance(case.get("name"), str):
            raise ValueError(f"{path.name}, case {index}: a mapping with a string `name` expected")
        where = f"{path.name}, case {index} ({case['name']!r})"
        if unknown := set(case) - CASE_KEYS:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        if case["name"] in names:
            raise ValueError(f"{where}: the name is used twice")
        names.add(case["name"])
        if not isinstance(case.get("request"), dict):
            raise ValueError(f"{where}: `request` must be a mapping")
        if case.get("request_type", "generate") not in ("generate", "tokenize"):
            raise ValueError(f"{where}: request_type must be generate or tokenize")
        if ("response" in case) == ("error" in case) and not case.get("skip_check"):
            raise ValueError(f"{where}: give either `response` or `error`")
        if "error" in case and "skip_check" in case:
            raise ValueError(f"{where}: skip_check with an expected error")
        if "error" in case and not isinstance(case["error"], dict):
            raise ValueError(f"{where}: `error` must be a mapping of `code` and `message`")
    return cases


CASES = load_cases(CASES_FILE)


def is_tokenize(case: dict[str, Any]) -> bool:
    return case.get("request_type", "generate") == "tokenize"


def streamable(case: dict[str, Any]) -> bool:
    """Single-input generate cases also run through GenerateStream (as in TGIS's runner)."""
    return not is_tokenize(case) and len(case["request"].get("requests", [])) == 1


STREAM_CASES = [case for case in CASES if streamable(case)]


def by_name(cases: list[dict[str, Any]]) -> Any:
    return pytest.mark.parametrize("case", cases, ids=[case["name"] for case in cases])


def approx(expected: Any) -> Any:
    """`expected` with each float replaced by pytest.approx, recursively: mappings must have
    the same keys and lists the same lengths; strings ("NaN" too) and integers compare
    exactly."""
    if isinstance(expected, dict):
        return {key: approx(value) for key, value in expected.items()}
    if isinstance(expected, list):
        return [approx(value) for value in expected]
    if isinstance(expected, float) and math.isfinite(expected):
        return pytest.approx(expected, rel=REL, abs=ABS)
    return expected


def differences(actual: Any, expected: Any, path: str = "") -> list[str]:
    """Where `actual` differs from `expected` (floats approximately), one line each."""
    if isinstance(actual, dict) and isinstance(expected, dict):
        lines = []
        for key in [*expected, *(k for k in actual if k not in expected)]:
            where = f"{path}.{key}" if path else key
            if key not in actual:
                lines.append(f"{where}: missing, expected {expected[key]!r}")
            elif key not in expected:
                lines.append(f"{where}: {actual[key]!r}, expected nothing")
            else:
                lines += differences(actual[key], expected[key], where)
        return lines
    if isinstance(actual, list) and isinstance(expected, list) and len(actual) == len(expected):
        lines = []
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            lines += differences(a, e, f"{path}[{index}]")
        return lines
    return [] if actual == approx(expected) else [f"{path}: {actual!r}, expected {expected!r}"]


class _CaseDumper(yaml.SafeDumper):
    """Strings with line breaks or edge spaces double-quoted, as the cases write them."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    quoted = value != value.strip() or any(c in value for c in "\n\r\t")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"' if quoted else None)


_CaseDumper.add_representer(str, _represent_str)


def as_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_CaseDumper, sort_keys=False, allow_unicode=True, width=100)


def check_equal(actual: Any, expected: Any, what: str, shown: Any = None) -> None:
    """Fail with the differences and what came back (`shown`, else `actual`) as YAML, ready
    to compare with the case."""
    if actual == approx(expected):
        return
    lines = ["differences:", *differences(actual, expected), "", f"{what}:"]
    report = "\n".join(lines) + "\n" + as_yaml(actual if shown is None else shown)
    pytest.fail(report, pytrace=False)


# --- the server -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    """This environment without any setting `tgis serve` would read (flags decide here), with
    warmup off (the demo model on cpu compiles nothing)."""
    settings = set(ENV_NAMES.values()) | {alias.upper() for alias in ALIASES}
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in settings and not key.startswith(("MAX_", "HF_", "TGIS_", "MODEL_"))
    }
    env.pop("PREFIX_STORE_PATH", None)
    env["WARMUP_ENABLED"] = "false"
    return env


def log_tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pb_grpc.GenerationServiceStub]:
    """`tgis serve` on the demo model with TGIS's test limits; a stub on its gRPC port."""
    grpc_port = free_port()
    log = tmp_path_factory.mktemp("tgis-serve") / "serve.log"
    command = [
        sys.executable,
        "-m",
        "tgis",
        "serve",
        "--model-id",
        str(DEMO_MODEL),
        "--backend",
        "cpu",  # the expected floats were recorded on cpu
        "--hostname",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--grpc-port",
        str(grpc_port),
        "--max-sequence-length",
        str(MAX_SEQUENCE_LENGTH),
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
        "--max-batch-size",
        "8",
        "--dtype-str",
        "float32",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=server_env(), cwd=ROOT
        )
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        client = pb_grpc.GenerationServiceStub(channel)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tgis serve exited with {proc.returncode}:\n{log_tail(log)}")
            try:
                client.ModelInfo(pb.ModelInfoRequest(), timeout=2)
                break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tgis serve did not answer in {STARTUP_TIMEOUT_S} s:\n{log_tail(log)}")
            time.sleep(0.2)
        yield client
    finally:
        channel.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# --- the cases, unary -----------------------------------------------------------------------


def call(stub: pb_grpc.GenerationServiceStub, case: dict[str, Any]) -> dict[str, Any]:
    """Send the case's request; the response as a dict (raises grpc.RpcError)."""
    if is_tokenize(case):
        request = json_format.ParseDict(case["request"], pb.BatchedTokenizeRequest())
        response = stub.Tokenize(request, timeout=CALL_TIMEOUT_S)
    else:
        request = json_format.ParseDict(case["request"], pb.BatchedGenerationRequest())
        response = stub.Generate(request, timeout=CALL_TIMEOUT_S)
    return json_format.MessageToDict(response)


def check_error(err: grpc.RpcError, expected: dict[str, Any] | None) -> None:
    if expected is None:
        pytest.fail(f"unexpected error {err.code().name}: {err.details()}")
    if "code" in expected:
        assert err.code().name == expected["code"], err.details()
    if "message" in expected:
        assert err.details() == expected["message"]


@by_name(CASES)
def test_unary(stub: pb_grpc.GenerationServiceStub, case: dict[str, Any]) -> None:
    expected_error = case.get("error")
    try:
        actual = call(stub, case)
    except grpc.RpcError as err:
        check_error(err, expected_error)
        return
    assert expected_error is None, f"expected {expected_error}, got:\n{as_yaml(actual)}"
    expected = case.get("response")
    if case.get("skip_check"):
        if expected is not None and not is_tokenize(case):
            # As TGIS's runner: what does not depend on the generated tokens still compares.
            got, want = actual.get("responses", []), expected.get("responses", [])
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert g.get("inputTokenCount") == w.get("inputTokenCount")
                assert g.get("inputTokens") == approx(w.get("inputTokens"))
        return
    check_equal(actual, expected, "the response")


# --- the cases, streamed --------------------------------------------------------------------


@by_name(STREAM_CASES)
def test_stream(stub: pb_grpc.GenerationServiceStub, case: dict[str, Any]) -> None:
    """GenerateStream with the case's one input: the first message has the input token count
    (and the seed when sampling, the input text when asked), a second the input tokens when
    asked; then the new text and tokens, with generatedTokenCount rising and the stop reason
    and seed only on the last. Joined, they are the unary response."""
    body = {key: value for key, value in case["request"].items() if key != "requests"}
    body["request"] = case["request"]["requests"][0]
    request = json_format.ParseDict(body, pb.SingleGenerationRequest())
    options = request.params.response
    sampling = request.params.method == pb.SAMPLE
    skip_check = bool(case.get("skip_check"))

    messages: list[dict[str, Any]] = []
    try:
        for message in stub.GenerateStream(request, timeout=CALL_TIMEOUT_S):
            messages.append(json_format.MessageToDict(message))
    except grpc.RpcError as err:
        # A refused request is refused before any message.
        assert not messages, f"error {err.code().name} after {len(messages)} messages"
        check_error(err, case.get("error"))
        return
    assert "error" not in case, f"expected {case['error']}, got messages {messages}"
    expected = (case.get("response") or {}).get("responses", [{}])[0]

    assert len(messages) >= 2, messages
    first, rest = messages[0], messages[1:]
    assert set(first) <= {"inputTokenCount", "seed", "text"}, first
    if "inputTokenCount" in expected:
        assert first.get("inputTokenCount") == expected["inputTokenCount"]
    if skip_check:
        assert ("seed" in first) == sampling
    else:
        assert first.get("seed") == expected.get("seed")
    if options.input_text:
        assert first.get("text") == request.request.text
    else:
        assert "text" not in first

    if options.input_tokens:
        second = rest.pop(0)
        assert set(second) <= {"inputTokenCount", "inputTokens"}, second
        if "inputTokens" in expected:
            check_equal(second.get("inputTokens"), expected["inputTokens"], "the input tokens")

    assert rest, "no generated-token messages"
    text = first.get("text", "")
    tokens: list[dict[str, Any]] = []
    count = 0
    for index, message in enumerate(rest):
        assert "inputTokenCount" not in message and "inputTokens" not in message, message
        if index < len(rest) - 1:
            assert not {"stopReason", "stopSequence", "seed"} & set(message), message
        assert message.get("generatedTokenCount", 0) > count, (count, message)
        count = message["generatedTokenCount"]
        text += message.get("text", "")
        tokens += message.get("tokens", [])
    last = rest[-1]
    assert "stopReason" in last, last
    if sampling:
        assert last.get("seed") == first.get("seed")
    if skip_check:
        return
    joined = {
        "text": text,
        "generatedTokenCount": count,
        "stopReason": last.get("stopReason"),
        "stopSequence": last.get("stopSequence"),
        "seed": last.get("seed"),
        "tokens": tokens,
    }
    wanted = {
        "text": expected.get("text", ""),
        "generatedTokenCount": expected.get("generatedTokenCount"),
        "stopReason": expected.get("stopReason"),
        "stopSequence": expected.get("stopSequence"),
        "seed": expected.get("seed"),
        "tokens": expected.get("tokens", []),
    }
    check_equal(joined, wanted, "the messages", shown=messages)


# --- what the case format cannot say --------------------------------------------------------


def test_model_info(stub: pb_grpc.GenerationServiceStub) -> None:
    info = stub.ModelInfo(pb.ModelInfoRequest(model_id="any name"), timeout=CALL_TIMEOUT_S)
    assert info.model_kind == pb.ModelInfoResponse.DECODER_ONLY
    assert info.max_sequence_length == MAX_SEQUENCE_LENGTH
    assert info.max_new_tokens == MAX_NEW_TOKENS


SAMPLING_WITHOUT_SEED = {
    "params": {"method": "SAMPLE", "stopping": {"maxNewTokens": 6}},
    "requests": [{"text": "def add(a, b):"}],
}


def test_sampling_without_a_seed_returns_the_seed_it_drew(
    stub: pb_grpc.GenerationServiceStub,
) -> None:
    """A random 32-bit seed, returned; sending it back gives the same text."""
    request = json_format.ParseDict(SAMPLING_WITHOUT_SEED, pb.BatchedGenerationRequest())
    responses = [stub.Generate(request, timeout=CALL_TIMEOUT_S).responses[0] for _ in range(2)]
    seeds = [r.seed for r in responses]
    assert all(0 < seed < 2**32 for seed in seeds), seeds
    assert seeds[0] != seeds[1]  # two draws of 32 bits

    request.params.sampling.seed = seeds[0]
    replay = stub.Generate(request, timeout=CALL_TIMEOUT_S).responses[0]
    assert (replay.seed, replay.text) == (seeds[0], responses[0].text)

    single = pb.SingleGenerationRequest(request=request.requests[0], params=request.params)
    single.params.sampling.ClearField("seed")
    messages = list(stub.GenerateStream(single, timeout=CALL_TIMEOUT_S))
    assert 0 < messages[0].seed < 2**32
    assert messages[-1].seed == messages[0].seed
    assert all(m.seed == 0 for m in messages[1:-1])


def test_batch_inputs_without_a_seed_draw_their_own(stub: pb_grpc.GenerationServiceStub) -> None:
    """TGIS's `_test_multi_input_seeds`: identical sampled inputs in one batch get different
    seeds, hence different texts."""
    body = {
        "params": {"method": "SAMPLE", "sampling": {"topK": 20}, "stopping": {"maxNewTokens": 8}},
        "requests": [{"text": "The same input multiple times:\n"}] * 5,
    }
    request = json_format.ParseDict(body, pb.BatchedGenerationRequest())
    responses = stub.Generate(request, timeout=CALL_TIMEOUT_S).responses
    assert all(0 <= r.seed < 2**32 for r in responses)
    assert len({r.seed for r in responses}) == len(responses)
    assert len({r.text for r in responses}) > 1


def test_stream_without_a_request(stub: pb_grpc.GenerationServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(pb.SingleGenerationRequest(), timeout=CALL_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "missing request"
