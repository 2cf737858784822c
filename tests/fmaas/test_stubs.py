"""The checked-in gRPC stubs match the proto, and the proto matches TGIS's wire format."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from tgis.fmaas import generation_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")

T = FieldDescriptor
# TGIS's messages: (field name, number, proto type, repeated) from ../shared/tgis-grpc-api.md.
FIELDS = {
    "BatchedGenerationRequest": [
        ("model_id", 1, T.TYPE_STRING, False),
        ("prefix_id", 2, T.TYPE_STRING, False),
        ("requests", 3, T.TYPE_MESSAGE, True),
        # The TGIS adapter for vLLM's LoRA adapter field.
        ("adapter_id", 4, T.TYPE_STRING, False),
        ("params", 10, T.TYPE_MESSAGE, False),
    ],
    "SingleGenerationRequest": [
        ("model_id", 1, T.TYPE_STRING, False),
        ("prefix_id", 2, T.TYPE_STRING, False),
        ("request", 3, T.TYPE_MESSAGE, False),
        ("adapter_id", 4, T.TYPE_STRING, False),
        ("params", 10, T.TYPE_MESSAGE, False),
    ],
    "BatchedGenerationResponse": [("responses", 1, T.TYPE_MESSAGE, True)],
    "GenerationRequest": [("text", 2, T.TYPE_STRING, False)],
    "GenerationResponse": [
        ("input_token_count", 6, T.TYPE_UINT32, False),
        ("generated_token_count", 2, T.TYPE_UINT32, False),
        ("text", 4, T.TYPE_STRING, False),
        ("stop_reason", 7, T.TYPE_ENUM, False),
        ("stop_sequence", 11, T.TYPE_STRING, False),
        ("seed", 10, T.TYPE_UINT64, False),
        ("tokens", 8, T.TYPE_MESSAGE, True),
        ("input_tokens", 9, T.TYPE_MESSAGE, True),
    ],
    "Parameters": [
        ("method", 1, T.TYPE_ENUM, False),
        ("sampling", 2, T.TYPE_MESSAGE, False),
        ("stopping", 3, T.TYPE_MESSAGE, False),
        ("response", 4, T.TYPE_MESSAGE, False),
        ("decoding", 5, T.TYPE_MESSAGE, False),
        ("truncate_input_tokens", 6, T.TYPE_UINT32, False),
    ],
    "DecodingParameters": [
        ("repetition_penalty", 1, T.TYPE_FLOAT, False),
        ("length_penalty", 2, T.TYPE_MESSAGE, False),
    ],
    "DecodingParameters.LengthPenalty": [
        ("start_index", 1, T.TYPE_UINT32, False),
        ("decay_factor", 2, T.TYPE_FLOAT, False),
    ],
    "SamplingParameters": [
        ("temperature", 1, T.TYPE_FLOAT, False),
        ("top_k", 2, T.TYPE_UINT32, False),
        ("top_p", 3, T.TYPE_FLOAT, False),
        ("typical_p", 4, T.TYPE_FLOAT, False),
        ("seed", 5, T.TYPE_UINT64, False),
    ],
    "StoppingCriteria": [
        ("max_new_tokens", 1, T.TYPE_UINT32, False),
        ("min_new_tokens", 2, T.TYPE_UINT32, False),
        ("time_limit_millis", 3, T.TYPE_UINT32, False),
        ("stop_sequences", 4, T.TYPE_STRING, True),
        ("include_stop_sequence", 5, T.TYPE_BOOL, False),
    ],
    "ResponseOptions": [
        ("input_text", 1, T.TYPE_BOOL, False),
        ("generated_tokens", 2, T.TYPE_BOOL, False),
        ("input_tokens", 3, T.TYPE_BOOL, False),
        ("token_logprobs", 4, T.TYPE_BOOL, False),
        ("token_ranks", 5, T.TYPE_BOOL, False),
        ("top_n_tokens", 6, T.TYPE_UINT32, False),
    ],
    "TokenInfo": [
        ("text", 2, T.TYPE_STRING, False),
        ("logprob", 3, T.TYPE_FLOAT, False),
        ("rank", 4, T.TYPE_UINT32, False),
        ("top_tokens", 5, T.TYPE_MESSAGE, True),
    ],
    "TokenInfo.TopToken": [
        ("text", 2, T.TYPE_STRING, False),
        ("logprob", 3, T.TYPE_FLOAT, False),
    ],
    "BatchedTokenizeRequest": [
        ("model_id", 1, T.TYPE_STRING, False),
        ("requests", 2, T.TYPE_MESSAGE, True),
        ("return_tokens", 3, T.TYPE_BOOL, False),
        ("return_offsets", 4, T.TYPE_BOOL, False),
        ("truncate_input_tokens", 5, T.TYPE_UINT32, False),
    ],
    "BatchedTokenizeResponse": [("responses", 1, T.TYPE_MESSAGE, True)],
    "TokenizeRequest": [("text", 1, T.TYPE_STRING, False)],
    "TokenizeResponse": [
        ("token_count", 1, T.TYPE_UINT32, False),
        ("tokens", 2, T.TYPE_STRING, True),
        ("offsets", 3, T.TYPE_MESSAGE, True),
    ],
    "TokenizeResponse.Offset": [
        ("start", 1, T.TYPE_UINT32, False),
        ("end", 2, T.TYPE_UINT32, False),
    ],
    "ModelInfoRequest": [("model_id", 1, T.TYPE_STRING, False)],
    "ModelInfoResponse": [
        ("model_kind", 1, T.TYPE_ENUM, False),
        ("max_sequence_length", 2, T.TYPE_UINT32, False),
        ("max_new_tokens", 3, T.TYPE_UINT32, False),
    ],
}
ENUMS = {
    "DecodingMethod": {"GREEDY": 0, "SAMPLE": 1},
    "StopReason": {
        "NOT_FINISHED": 0,
        "MAX_TOKENS": 1,
        "EOS_TOKEN": 2,
        "CANCELLED": 3,
        "TIME_LIMIT": 4,
        "STOP_SEQUENCE": 5,
        "TOKEN_LIMIT": 6,
        "ERROR": 7,
    },
    "ModelInfoResponse.ModelKind": {"DECODER_ONLY": 0, "ENCODER_DECODER": 1},
}
METHODS = {
    "Generate": ("BatchedGenerationRequest", "BatchedGenerationResponse", False),
    "GenerateStream": ("SingleGenerationRequest", "GenerationResponse", True),
    "Tokenize": ("BatchedTokenizeRequest", "BatchedTokenizeResponse", False),
    "ModelInfo": ("ModelInfoRequest", "ModelInfoResponse", False),
}


def message(name: str):  # type: ignore[no-untyped-def]
    descriptor = pb.DESCRIPTOR.message_types_by_name[name.split(".")[0]]
    for nested in name.split(".")[1:]:
        descriptor = descriptor.nested_types_by_name[nested]
    return descriptor


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_fields_are_tgis_numbers_and_types(name: str) -> None:
    descriptor = message(name)
    got = [(f.name, f.number, f.type, f.is_repeated) for f in descriptor.fields]
    assert sorted(got) == sorted(FIELDS[name])


def test_enums_package_and_service_are_tgis() -> None:
    assert pb.DESCRIPTOR.package == "fmaas"
    for name, values in ENUMS.items():
        if "." in name:
            outer, inner = name.split(".")
            enum = pb.DESCRIPTOR.message_types_by_name[outer].enum_types_by_name[inner]
        else:
            enum = pb.DESCRIPTOR.enum_types_by_name[name]
        assert {v.name: v.number for v in enum.values} == values
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    assert service.full_name == "fmaas.GenerationService"
    for method in service.methods:
        request, response, streaming = METHODS[method.name]
        assert (method.input_type.name, method.output_type.name) == (request, response)
        assert method.server_streaming is streaming and not method.client_streaming
    assert {m.name for m in service.methods} == set(METHODS)
    # Optional fields keep presence, as TGIS's clients rely on it.
    assert message("SamplingParameters").fields_by_name["seed"].has_presence
    assert message("StoppingCriteria").fields_by_name["include_stop_sequence"].has_presence


def test_checked_in_stubs_are_generated_from_the_proto(tmp_path: Path) -> None:
    """`make grpc-stubs` would change nothing (grpcio-tools is pinned in the dev extra)."""
    pytest.importorskip("grpc_tools")
    (tmp_path / "tgis" / "fmaas").mkdir(parents=True)
    shutil.copy(ROOT / "tgis" / "fmaas" / "generation.proto", tmp_path / "tgis" / "fmaas")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", "tgis/fmaas/generation.proto"],
        cwd=tmp_path, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    for name in GENERATED:
        fresh = (tmp_path / "tgis" / "fmaas" / name).read_text()
        assert (ROOT / "tgis" / "fmaas" / name).read_text() == fresh, (
            f"tgis/fmaas/{name} is stale: run `make grpc-stubs`"
        )
