"""The parts of `tgis benchmark` between its flags and the load core: option checks, the
workload, reading compared runs, and writing results and plots."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from tgis.benchmark.images import (
    DEFAULT_IMAGE_FORMAT,
    DEFAULT_IMAGE_SIZE,
    FORMATS,
    MAX_IMAGE_SIDE,
    MAX_IMAGES_PER_PROMPT,
    MAX_POOL_PIXELS,
    ImageSpec,
    parse_size,
)
from tgis.benchmark.load import StepWindow
from tgis.benchmark.metrics import parse_slos
from tgis.benchmark.profiles import LengthDistribution, Profile, get_profile
from tgis.benchmark.prompts import Session, build_sessions
from tgis.benchmark.report import is_engine
from tgis.benchmark.results import read_results, validate_results, write_results
from tgis.benchmark.runner import KINDS
from tgis.errors import ConfigError, TgisError


def step_window(
    duration: float, warmup: float, max_requests: int | None, warmup_requests: int
) -> StepWindow:
    """The window of every step, from --duration, --warmup, --max-requests, --warmup-requests."""
    if max_requests is not None and max_requests < 1:
        raise ConfigError(
            f"--max-requests {max_requests} must be at least 1",
            "leave it out to measure for --duration seconds",
        )
    if warmup_requests < 0:
        raise ConfigError(f"--warmup-requests {warmup_requests} must be >= 0")
    return StepWindow(duration, warmup, max_requests=max_requests, warmup_requests=warmup_requests)


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


def image_spec(
    base: ImageSpec | None,
    images_per_prompt: int | None,
    image_size: str | None,
    image_format: str | None,
    unique_images: bool | None,
) -> ImageSpec | None:
    """The images of each prompt: the profile's (`base`) with --images-per-prompt,
    --image-size, --image-format and --unique-images/--repeat-images applied; None for text
    only. A flag that would shape no image is an error, not ignored."""
    if images_per_prompt is not None and not 0 <= images_per_prompt <= MAX_IMAGES_PER_PROMPT:
        raise ConfigError(
            f"--images-per-prompt {images_per_prompt} must be 0 to {MAX_IMAGES_PER_PROMPT}",
            "e.g. --images-per-prompt 4 (tgis serve takes 8 per request by default, "
            "--max-images-per-request; 0 sends text only)",
        )
    if images_per_prompt is not None:
        per_prompt = images_per_prompt
    else:
        per_prompt = base.per_prompt if base else 0
    if not per_prompt:
        given = [
            flag
            for flag, value in (
                ("--image-size", image_size),
                ("--image-format", image_format),
                ("--unique-images/--repeat-images", unique_images),
            )
            if value is not None
        ]
        if given:
            why = "--images-per-prompt 0 sends" if images_per_prompt == 0 else "this profile sends"
            flags = " and ".join(given)
            raise ConfigError(
                f"{given[0]} shapes the prompts' images, and {why} none",
                f"add --images-per-prompt N or use --profile vision, or drop {flags}",
            )
        return None
    width, height = (base.width, base.height) if base else DEFAULT_IMAGE_SIZE
    if image_size is not None:
        try:
            width, height = parse_size(image_size)
        except ValueError as exc:
            raise ConfigError(f"--image-size: {exc}", "e.g. --image-size 512x512") from None
        if not (1 <= width <= MAX_IMAGE_SIDE and 1 <= height <= MAX_IMAGE_SIDE):
            raise ConfigError(
                f"--image-size {image_size}: each side must be 1 to {MAX_IMAGE_SIDE} pixels",
                "e.g. --image-size 512x512",
            )
    if image_format is not None and image_format not in FORMATS:
        raise ConfigError(
            f"unknown --image-format {image_format!r}", f"choose one of {', '.join(FORMATS)}"
        )
    return ImageSpec(
        per_prompt,
        width,
        height,
        format=image_format or (base.format if base else DEFAULT_IMAGE_FORMAT),
        unique=unique_images if unique_images is not None else (base.unique if base else True),
    )


def choose_profile(
    name: str,
    prompt_tokens: int | None,
    decode_tokens: int | None,
    requests: int = 1,
    images_per_prompt: int | None = None,
    image_size: str | None = None,
    image_format: str | None = None,
    unique_images: bool | None = None,
) -> Profile:
    """The profile `name` with the --prompt-tokens/--decode-tokens and image flags applied;
    `requests` sessions of its images must fit in MAX_POOL_PIXELS (they are built up front)."""
    try:
        profile = get_profile(name)
    except ValueError as exc:
        raise ConfigError(f"--profile: {exc}") from None
    for flag, value in (("--prompt-tokens", prompt_tokens), ("--decode-tokens", decode_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    images = image_spec(profile.images, images_per_prompt, image_size, image_format, unique_images)
    if images is not None and images.pool_pixels(requests) > MAX_POOL_PIXELS:
        mib = images.pool_pixels(requests) * 3 // 2**20
        raise ConfigError(
            f"{images.distinct(requests)} distinct images of {images.size} ({mib} MiB of "
            f"pixels) are more than the {MAX_POOL_PIXELS * 3 // 2**20} MiB of images the "
            "benchmark builds before a run",
            "lower --requests, --images-per-prompt or --image-size, or send the same images "
            "in every request with --repeat-images",
        )
    return profile.with_lengths(
        prompt=LengthDistribution.fixed(prompt_tokens) if prompt_tokens else None,
        decode=LengthDistribution.fixed(decode_tokens) if decode_tokens else None,
    ).with_images(images)


# The APIs whose requests carry no images, by the name their refusals give them.
TEXT_ONLY_APIS = {
    "openai-completions": "OpenAI's completions API",
    "embeddings": "OpenAI's embeddings API",
}


def check_images_api(api: str, images: ImageSpec | None) -> None:
    """Images need an API that carries them: TGI's (markdown images) or OpenAI's chat API."""
    if images is not None and api in TEXT_ONLY_APIS:
        raise ConfigError(
            f"{TEXT_ONLY_APIS[api]} takes text only, and the prompts carry images "
            f"({images.describe()})",
            "use --api openai-chat or --api tgi, or --images-per-prompt 0 for text only",
        )


def build_workload(profile: Profile, tokenizer: Any, requests: int, seed: int) -> list[Session]:
    """The `requests` sessions of `profile` (from choose_profile), cut with `tokenizer`."""
    try:
        return build_sessions(profile, tokenizer, requests, seed)
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


def ignore_eos_fields(ignore_eos: bool, schema: dict[str, Any] | None) -> dict[str, Any]:
    """--ignore-eos's request field, `ignore_eos: true` (vLLM's name, which tgis serve and
    llama.cpp's server take too): the client puts it in TGI's `parameters` and at the top of an
    OpenAI body. Nothing without the flag. A --json-schema answer ends with EOS once it
    matches, so the two are refused together, as servers refuse them."""
    if not ignore_eos:
        return {}
    if schema is not None:
        raise ConfigError(
            "--ignore-eos cannot be combined with --json-schema: an answer that matches the "
            "schema ends with EOS, the only token its grammar then allows",
            "drop one of them",
        )
    return {"ignore_eos": True}


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
