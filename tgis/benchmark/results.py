"""The results file of `tgis benchmark`: config, system, per-step metrics (schema version 1).

An in-process run (`--engine`) has a config with `mode: "engine"`, no `steps` and an
`engine_steps` array (prefill and decode timings per batch size): both fields added within
version 1, so older files still validate. So is a step's optional `token_check` (the stream's
token counts against the re-tokenized answers, null when no tokenizer was given), a step's
optional `output_lengths` (the answers' output tokens against the max_new_tokens they asked
for), the config's optional `ignore_eos` and the profile's optional `images` (what each request
carried: count, size, format, unique or not).

    data = build_results(config, [summarize(step, slos) for step in steps])
    validate_results(data)          # ValueError naming the offending field (needs jsonschema)
    write_results(path, data)

The shape is `RESULTS_SCHEMA` (JSON Schema draft 2020-12). It is stable: fields may be added
within a version; renaming, removing or retyping one bumps `schema_version`. All durations are
seconds (`*_s`), all rates per second (`*_per_s`); a latency distribution is null when no
successful request measured it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import tgis

SCHEMA_VERSION = 1

_NUMBER = {"type": "number"}
_COUNT = {"type": "integer", "minimum": 0}
_DISTRIBUTION = {
    "type": ["object", "null"],
    "required": ["p50", "p90", "p95", "p99", "mean"],
    "properties": {k: _NUMBER for k in ("p50", "p90", "p95", "p99", "mean")},
}
_TOKEN_CHECK = {
    "type": ["object", "null"],
    "required": ["requests", "stream_tokens", "tokenizer_tokens", "agreeing_requests", "ratio"],
    "properties": {
        "requests": _COUNT,
        "stream_tokens": _COUNT,
        "tokenizer_tokens": _COUNT,
        "agreeing_requests": _COUNT,
        "ratio": {"type": ["number", "null"], "minimum": 0},
    },
}
_OUTPUT_LENGTHS = {
    "type": ["object", "null"],
    "required": ["requests", "short_requests", "tokens", "asked"],
    "properties": {
        "requests": _COUNT,
        "short_requests": _COUNT,
        "tokens": {
            "type": "object",
            "required": ["min", "p50", "mean", "max"],
            "properties": {
                k: {"type": "number", "minimum": 0} for k in ("min", "p50", "mean", "max")
            },
        },
        "asked": {
            "type": "object",
            "required": ["min", "mean", "max"],
            "properties": {k: {"type": "number", "minimum": 0} for k in ("min", "mean", "max")},
        },
    },
}
_STEP = {
    "type": "object",
    "required": [
        "kind",
        "target",
        "elapsed_s",
        "requests",
        "errors",
        "ttft_s",
        "itl_s",
        "tpot_s",
        "e2e_s",
        "prompt_tokens",
        "output_tokens",
        "output_tokens_per_s",
        "total_tokens_per_s",
        "requests_per_s",
        "goodput",
    ],
    "properties": {
        "kind": {"enum": ["throughput", "rate"]},
        "target": {"type": "number", "exclusiveMinimum": 0},
        "elapsed_s": _NUMBER,
        "requests": {
            "type": "object",
            "required": ["total", "ok", "failed", "warmup"],
            "properties": {k: _COUNT for k in ("total", "ok", "failed", "warmup")},
        },
        "errors": {"type": "object", "additionalProperties": _COUNT},
        "ttft_s": _DISTRIBUTION,
        "itl_s": _DISTRIBUTION,
        "tpot_s": _DISTRIBUTION,
        "e2e_s": _DISTRIBUTION,
        "prompt_tokens": _COUNT,
        "output_tokens": _COUNT,
        "output_tokens_per_s": _NUMBER,
        "total_tokens_per_s": _NUMBER,
        "requests_per_s": _NUMBER,
        "goodput": {
            "type": ["object", "null"],
            "required": ["slos_s", "requests", "requests_per_s", "fraction"],
            "properties": {
                "slos_s": {"type": "object", "additionalProperties": _NUMBER},
                "requests": _COUNT,
                "requests_per_s": _NUMBER,
                "fraction": {"type": "number", "minimum": 0, "maximum": 1},
            },
        },
        # Optional (added within version 1): see metrics.token_check.
        "token_check": _TOKEN_CHECK,
        # Optional (added within version 1): see metrics.output_lengths.
        "output_lengths": _OUTPUT_LENGTHS,
    },
}
_ENGINE_STEP = {
    "type": "object",
    "required": [
        "batch_size",
        "runs",
        "prompt_tokens",
        "decode_tokens",
        "prefill_latency_s",
        "prefill_tokens_per_s",
        "decode_latency_s",
        "decode_tokens_per_s",
    ],
    "properties": {
        "batch_size": {"type": "integer", "minimum": 1},
        "runs": _COUNT,
        "prompt_tokens": _COUNT,
        "decode_tokens": _COUNT,
        "prefill_latency_s": _DISTRIBUTION,
        "prefill_tokens_per_s": _NUMBER,
        "decode_latency_s": _DISTRIBUTION,
        "decode_tokens_per_s": _NUMBER,
        # Optional (added within version 1): the batch's decode steps in the serving engine's
        # loop, their forward, and the host work around it (the step less its forward).
        "decode_step_s": _DISTRIBUTION,
        "decode_forward_s": _DISTRIBUTION,
        "decode_host_s": _DISTRIBUTION,
        # Optional (added within version 1): with a simulated device, its busy time in each
        # of those steps, the host work hidden behind it, and the host work it waited for.
        "decode_device_s": _DISTRIBUTION,
        "decode_hidden_host_s": _DISTRIBUTION,
        "decode_exposed_host_s": _DISTRIBUTION,
    },
}
_HTTP_CONFIG = {
    "type": "object",
    "required": ["url", "api", "kind", "profile", "seed"],
    "properties": {
        "url": {"type": "string"},
        "api": {"enum": ["tgi", "openai-chat", "openai-completions", "embeddings"]},
        "kind": {"enum": ["throughput", "rate", "sweep"]},
        "profile": {
            "type": "object",
            "required": ["name", "prompt", "decode", "turns"],
            "properties": {
                # Optional (added within version 1): the images of each request, or null.
                "images": {
                    "type": ["object", "null"],
                    "required": ["per_prompt", "width", "height", "format", "unique"],
                    "properties": {
                        "per_prompt": {"type": "integer", "minimum": 1},
                        "width": {"type": "integer", "minimum": 1},
                        "height": {"type": "integer", "minimum": 1},
                        "format": {"enum": ["png", "jpeg"]},
                        "unique": {"type": "boolean"},
                    },
                },
            },
        },
        "seed": {"type": "integer"},
        # The schema every answer had to match (--json-schema), or null.
        "json_schema": {"type": ["object", "null"]},
        # The LoRA adapters requests went through in turn (--adapters; "" the base model).
        "adapters": {"type": "array", "items": {"type": "string"}},
        # Optional (added within version 1): whether requests carried ignore_eos (--ignore-eos).
        "ignore_eos": {"type": "boolean"},
        # Optional (added within version 1): the step's request counts (--max-requests, null
        # when the duration alone ends it; --warmup-requests).
        "max_requests": {"type": ["integer", "null"], "minimum": 1},
        "warmup_requests": {"type": "integer", "minimum": 0},
    },
}
_ENGINE_CONFIG = {
    "type": "object",
    "required": [
        "mode",
        "model",
        "device",
        "batch_sizes",
        "prompt_tokens",
        "decode_tokens",
        "runs",
        "seed",
    ],
    "properties": {
        "mode": {"const": "engine"},
        "model": {"type": "string"},
        "device": {"type": "string"},
        "dtype": {"type": ["string", "null"]},
        "batch_sizes": {"type": "array", "items": {"type": "integer", "minimum": 1}},
        "prompt_tokens": {"type": "integer", "minimum": 1},
        "decode_tokens": {"type": "integer", "minimum": 1},
        "runs": {"type": "integer", "minimum": 1},
        "seed": {"type": "integer"},
        # Optional (added within version 1): the simulated device's step, or null.
        "simulated_device_ms": {"type": ["number", "null"], "minimum": 0},
        # Optional (added within version 1): --async-scheduling as given (null: the default).
        "async_scheduling": {"type": ["boolean", "null"]},
        # Optional (added within version 1): the serving loop's requests' sampling.
        "sampling": {"enum": ["greedy", "mixed"]},
    },
}
RESULTS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tgis benchmark results",
    "type": "object",
    "required": ["schema_version", "tool", "created_at", "config", "system", "steps"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "tool": {
            "type": "object",
            "required": ["name", "version"],
            "properties": {"name": {"type": "string"}, "version": {"type": "string"}},
        },
        "created_at": {"type": "string"},
        # A load test of a server, or (`mode: engine`) an in-process run of a backend.
        "config": {
            "if": {
                "type": "object",
                "required": ["mode"],
                "properties": {"mode": {"const": "engine"}},
            },
            "then": _ENGINE_CONFIG,
            "else": _HTTP_CONFIG,
        },
        "system": {
            "type": "object",
            "required": ["cpu_model", "cpu_cores", "memory_bytes", "gpus", "os", "python"],
            "properties": {
                "cpu_model": {"type": ["string", "null"]},
                "cpu_cores": {"type": ["integer", "null"]},
                "memory_bytes": {"type": ["integer", "null"]},
                "gpus": {"type": "array", "items": {"type": "string"}},
                "os": {"type": "string"},
                "python": {"type": "string"},
            },
        },
        "steps": {"type": "array", "items": _STEP},
        # Optional: per batch size, the prefill and decode timings of `tgis benchmark --engine`.
        "engine_steps": {"type": "array", "items": _ENGINE_STEP},
    },
}


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def system_info() -> dict[str, Any]:
    """The machine the benchmark ran on (read from /proc where there is one).

    `gpus` is empty: the load generator does not look at the server's accelerators.
    """
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or None,
    )
    memory = next(
        (
            int(line.split()[1]) * 1024
            for line in _read("/proc/meminfo").splitlines()
            if line.startswith("MemTotal:")
        ),
        None,
    )
    return {
        "cpu_model": cpu_model,
        "cpu_cores": os.cpu_count(),
        "memory_bytes": memory,
        "gpus": [],
        "os": platform.platform(),
        "python": sys.version.split()[0],
    }


def build_results(
    config: dict[str, Any],
    steps: list[dict[str, Any]],
    system: dict[str, Any] | None = None,
    engine_steps: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The results document: `config` as run, `system` (default: this machine), step summaries
    (and the `engine_steps` of an in-process run, when given)."""
    data: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "tgis benchmark", "version": tgis.__version__},
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "config": config,
        "system": system_info() if system is None else system,
        "steps": steps,
    }
    if engine_steps is not None:
        data["engine_steps"] = engine_steps
    return data


def validate_results(data: Any) -> None:
    """Raise ValueError naming the first field of `data` that breaks RESULTS_SCHEMA.

    Needs the `jsonschema` package (a dev dependency: writing results does not).
    """
    try:
        import jsonschema
    except ImportError as exc:
        raise RuntimeError("validating results needs jsonschema: pip install jsonschema") from exc

    validator = jsonschema.Draft202012Validator(RESULTS_SCHEMA)
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise ValueError(f"invalid benchmark results at {where}: {error.message}")


def write_results(path: str | Path, data: dict[str, Any]) -> Path:
    """Write `data` as indented JSON (parent folders created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return out


def read_results(path: str | Path) -> dict[str, Any]:
    """Load a results file, checking only its schema version (validate_results for more)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: not a tgis benchmark results file of schema version {SCHEMA_VERSION}"
        )
    return data
