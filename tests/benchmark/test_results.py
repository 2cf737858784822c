"""The results document validates against RESULTS_SCHEMA; broken ones are named precisely."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tgis.benchmark.client import RequestRecord
from tgis.benchmark.load import StepResult
from tgis.benchmark.metrics import summarize
from tgis.benchmark.profiles import get_profile
from tgis.benchmark.results import (
    RESULTS_SCHEMA,
    SCHEMA_VERSION,
    build_results,
    read_results,
    system_info,
    validate_results,
    write_results,
)

CONFIG = {
    "url": "http://127.0.0.1:3000",
    "api": "tgi",
    "kind": "rate",
    "profile": get_profile("chat").to_dict(),
    "seed": 0,
    "duration_s": 60,
}


def results() -> dict[str, Any]:
    step = StepResult("rate", 1.5, 0.0, 1.0)
    step.records = [
        RequestRecord(0.1, 10, 2, end=0.5, token_times=[0.2, 0.3], output_tokens=2, text="a b"),
        RequestRecord(0.2, 10, 2, end=0.4, error="stream_closed"),
    ]
    empty = StepResult("throughput", 2, 0.0, 1.0)
    words = lambda text: len(text.split())  # noqa: E731
    return build_results(
        CONFIG, [summarize(step, {"ttft": 0.5}, words), summarize(empty, count_tokens=words)]
    )


def test_system_info() -> None:
    info = system_info()
    assert info["cpu_cores"] >= 1
    assert info["gpus"] == []
    if Path("/proc/meminfo").exists():
        assert info["memory_bytes"] > 1 << 20
        assert info["cpu_model"]


def test_results_validate_and_round_trip(tmp_path: Path) -> None:
    data = results()
    assert (
        data["schema_version"]
        == SCHEMA_VERSION
        == RESULTS_SCHEMA["properties"]["schema_version"]["const"]
    )
    validate_results(data)
    path = write_results(tmp_path / "out" / "results.json", data)
    assert read_results(path) == data


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: d.pop("steps"), r"at \(top level\): 'steps' is a required property"),
        (lambda d: d["steps"][0].update(kind="burst"), r"at steps/0/kind: 'burst' is not one of"),
        (lambda d: d["steps"][0]["errors"].update(timeout=-1), r"at steps/0/errors/timeout"),
        (lambda d: d["steps"][0]["ttft_s"].pop("p99"), r"at steps/0/ttft_s: 'p99' is a required"),
        (lambda d: d["config"].update(api="grpc"), r"at config/api"),
        (lambda d: d.update(schema_version=2), r"at schema_version: 1 was expected"),
        (
            lambda d: d["steps"][0]["token_check"].pop("agreeing_requests"),
            r"at steps/0/token_check: 'agreeing_requests' is a required property",
        ),
        (
            lambda d: d["steps"][0]["token_check"].update(ratio="1.0"),
            r"at steps/0/token_check/ratio: '1.0' is not of type",
        ),
        (
            lambda d: d["steps"][0]["output_lengths"].pop("short_requests"),
            r"at steps/0/output_lengths: 'short_requests' is a required property",
        ),
        (
            lambda d: d["steps"][0]["output_lengths"]["asked"].update(max=-1),
            r"at steps/0/output_lengths/asked/max: -1 is less than the minimum",
        ),
        (lambda d: d["config"].update(ignore_eos="yes"), r"at config/ignore_eos: 'yes' is not"),
    ],
)
def test_invalid_results_are_named(breakage: Any, message: str) -> None:
    data = copy.deepcopy(results())
    breakage(data)
    with pytest.raises(ValueError, match=message):
        validate_results(data)


def test_token_check_is_optional_and_may_be_null() -> None:
    data = results()
    first, empty = data["steps"]
    assert first["token_check"] == {
        "requests": 1,
        "stream_tokens": 2,
        "tokenizer_tokens": 2,
        "agreeing_requests": 1,
        "ratio": 1.0,
    }
    assert empty["token_check"]["ratio"] is None  # no request: nothing counted
    validate_results(data)
    first["token_check"] = None  # run without a tokenizer
    validate_results(data)
    for step in data["steps"]:
        del step["token_check"]  # a file written before the field existed
    validate_results(data)
    assert "token_check" not in RESULTS_SCHEMA["properties"]["steps"]["items"]["required"]


def test_output_lengths_and_ignore_eos_are_optional() -> None:
    data = results()
    first, empty = data["steps"]
    assert first["output_lengths"] == {
        "requests": 1,
        "short_requests": 0,
        "tokens": {"min": 2, "p50": 2.0, "mean": 2.0, "max": 2},
        "asked": {"min": 2, "mean": 2.0, "max": 2},
    }
    assert empty["output_lengths"] is None  # no request answered
    data["config"]["ignore_eos"] = True
    validate_results(data)
    del data["config"]["ignore_eos"]
    for step in data["steps"]:
        del step["output_lengths"]  # a file written before the fields existed
    validate_results(data)
    assert "output_lengths" not in RESULTS_SCHEMA["properties"]["steps"]["items"]["required"]


def test_read_results_checks_the_version(tmp_path: Path) -> None:
    path = write_results(tmp_path / "old.json", {**results(), "schema_version": 0})
    with pytest.raises(ValueError, match="not a tgis benchmark results file of schema version 1"):
        read_results(path)


def test_the_profiles_images_are_recorded_optional_and_checked() -> None:
    data = copy.deepcopy(results())
    assert data["config"]["profile"]["images"] is None  # a text profile
    validate_results(data)
    data["config"]["profile"] = get_profile("vision").to_dict()
    assert data["config"]["profile"]["images"] == {
        "per_prompt": 1, "width": 512, "height": 512, "format": "jpeg", "unique": True,
    }  # fmt: skip
    validate_results(data)
    del data["config"]["profile"]["images"]  # a file written before the field existed
    validate_results(data)
    for breakage, where in (
        ({"format": "gif"}, r"at config/profile/images/format: 'gif' is not one of"),
        ({"per_prompt": 0}, r"at config/profile/images/per_prompt: 0 is less than"),
        ({"unique": "yes"}, r"at config/profile/images/unique: 'yes' is not of type"),
    ):
        data["config"]["profile"] = get_profile("vision").to_dict()
        data["config"]["profile"]["images"].update(breakage)
        with pytest.raises(ValueError, match=where):
            validate_results(data)
