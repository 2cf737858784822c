"""The parts of `tgis benchmark` between its flags and the load core: option checks, the
workload, reading compared runs, and writing results and plots."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from tgis.benchmark.metrics import parse_slos
from tgis.benchmark.profiles import LengthDistribution, Profile, get_profile
from tgis.benchmark.prompts import Session, build_sessions
from tgis.benchmark.report import is_engine
from tgis.benchmark.results import read_results, validate_results, write_results
from tgis.benchmark.runner import KINDS
from tgis.errors import ConfigError, TgisError


def check_options(
    kind: str,
    rates: str | None,
    slo: str | None,
    duration: float,
    warmup: float,
    max_vus: int,
    num_rates: int,
    requests: int,
) -> tuple[list[float], dict[str, float]]:
    """Validate the load flags; returns the --rates list and the --slo limits (seconds)."""
    if kind not in KINDS:
        raise ConfigError(f"unknown --kind {kind!r}", f"choose one of {', '.join(KINDS)}")
    if duration <= 0 or warmup < 0:
        raise ConfigError(
            f"--duration {duration} and --warmup {warmup} must be > 0 and >= 0 seconds"
        )
    for flag, value in (
        ("--max-vus", max_vus),
        ("--num-rates", num_rates),
        ("--requests", requests),
    ):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    rate_list: list[float] = []
    if rates:
        try:
            rate_list = [float(r) for r in rates.split(",") if r.strip()]
        except ValueError:
            raise ConfigError(
                f"--rates {rates!r} is not a comma list of numbers", "e.g. --rates 1,2,4"
            ) from None
        if not rate_list or any(not 0 < r < float("inf") for r in rate_list):
            raise ConfigError(f"--rates {rates!r} must list positive rates", "e.g. --rates 1,2,4")
    if kind == "rate" and not rate_list:
        raise ConfigError("--kind rate needs --rates", "e.g. --rates 1,2,4 (sessions per second)")
    try:
        slos = parse_slos(slo) if slo else {}
    except ValueError as exc:
        raise ConfigError(f"--slo: {exc}") from None
    return rate_list, slos


def build_workload(
    name: str,
    prompt_tokens: int | None,
    decode_tokens: int | None,
    tokenizer: Any,
    requests: int,
    seed: int,
) -> tuple[Profile, list[Session]]:
    """The profile `name` with --prompt-tokens/--decode-tokens applied, and its sessions."""
    try:
        profile = get_profile(name)
    except ValueError as exc:
        raise ConfigError(f"--profile: {exc}") from None
    for flag, value in (("--prompt-tokens", prompt_tokens), ("--decode-tokens", decode_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    profile = profile.with_lengths(
        prompt=LengthDistribution.fixed(prompt_tokens) if prompt_tokens else None,
        decode=LengthDistribution.fixed(decode_tokens) if decode_tokens else None,
    )
    try:
        return profile, build_sessions(profile, tokenizer, requests, seed)
    except ValueError as exc:
        raise TgisError(f"cannot build the prompts: {exc}", "try other --prompt-tokens") from None


def read_json_schema(path: Path | None) -> dict[str, Any] | None:
    """--json-schema's file: a JSON object (the schema)."""
    if path is None:
        return None
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--json-schema {path}: {exc}", "give a file holding a JSON schema"
        ) from None
    if not isinstance(schema, dict):
        raise ConfigError(f"--json-schema {path} holds no JSON object", "give a JSON schema")
    return schema


def adapter_list(spec: str | None) -> tuple[str, ...]:
    """--adapters: the names, in order ("" for the base model); none when not given."""
    if spec is None:
        return ()
    return tuple(name.strip() for name in spec.split(","))


def structured_output(api: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    """The request fields that ask `api` for output matching `schema` (none without one)."""
    if schema is None:
        return {}
    if api == "tgi":
        return {"grammar": {"type": "json", "value": schema}}
    if api == "openai-chat":
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }
        }
    raise ConfigError(
        f"--json-schema needs TGI's API or OpenAI's chat API, not {api}",
        "use --api tgi or --api openai-chat",
    )


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """How many tokens `tokenizer` (a Hugging Face tokenizer) cuts a text into, specials aside."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count


def _describe(data: dict[str, Any]) -> str:
    return "an --engine (in-process) run" if is_engine(data) else "an HTTP load test"


def load_compared(paths: tuple[Path, Path]) -> list[tuple[str, dict[str, Any]]]:
    """The two results files of --compare, named by file name (by path when the names clash).
    Both must be HTTP load tests or both `--engine` runs."""
    loaded = []
    for path in paths:
        try:
            loaded.append(read_results(path))
        except (OSError, ValueError) as exc:
            raise TgisError(f"--compare: cannot read {path}: {exc}") from None
    if is_engine(loaded[0]) != is_engine(loaded[1]):
        raise TgisError(
            f"--compare: {paths[0]} is {_describe(loaded[0])} but {paths[1]} is "
            f"{_describe(loaded[1])}",
            "compare two load tests or two --engine runs",
        )
    names = [p.name for p in paths]
    if names[0] == names[1]:
        names = [str(p) for p in paths]
    return list(zip(names, loaded, strict=True))


def save(
    console: Console,
    output: Path | None,
    plot: Path | None,
    runs: list[tuple[str, dict[str, Any]]],
    data: dict[str, Any] | None = None,
) -> None:
    """Write `data` to `output` (validated when jsonschema is installed) and `runs` to `plot`."""
    if output is not None and data is not None:
        # RuntimeError: jsonschema is not installed (the document is built to the schema anyway).
        with contextlib.suppress(RuntimeError):
            validate_results(data)
        write_results(output, data)
        console.print(f"results: {output}")
    if plot is not None:
        try:
            from tgis.benchmark.plot import plot_engine, plot_results
        except ImportError as exc:
            raise TgisError(f"--plot needs matplotlib ({exc})", "pip install matplotlib") from None
        if runs and all(is_engine(data) for _, data in runs):
            plot_engine(plot, runs)
        else:
            plot_results(plot, runs)
        console.print(f"plot: {plot}")
