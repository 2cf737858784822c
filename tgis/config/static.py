"""Static-shape rules of the tpu and neuron backends (seeds 000 and 002).

Both run one internal static batch of `batch_size` slots and `sequence_length` positions, so
the launcher limits are not free: they follow from that shape. On Neuron the shape is fixed
when the model is compiled (its `config.neuron`); on TPU it comes from HF_BATCH_SIZE and
HF_SEQUENCE_LENGTH (or the flags). Unset flags are derived from the shape; set ones must agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tgis.config.dtypes import CAST_TO_DTYPE, CAST_TYPES
from tgis.config.env import Sources, env_int, env_value
from tgis.config.model import ModelFacts
from tgis.config.parse import flag
from tgis.config.types import StaticShape
from tgis.errors import ConfigError

# optimum-neuron's export defaults when neither the model nor HF_* says otherwise.
NEURON_DEFAULT_BATCH_SIZE = 1
NEURON_DEFAULT_SEQUENCE_LENGTH = 4096
NEURON_DEFAULT_NUM_CORES = 2
NEURON_DEFAULT_CAST = "bf16"
# A conservative TPU default: one slot over a 1024-token window.
TPU_DEFAULT_BATCH_SIZE = 1
TPU_DEFAULT_SEQUENCE_LENGTH = 1024


def _cast_from_env(env: Mapping[str, str]) -> str | None:
    raw = env_value(env, "HF_AUTO_CAST_TYPE")
    if raw is None:
        return None
    cast = raw.lower()
    if cast not in CAST_TYPES:
        raise ConfigError(
            f"HF_AUTO_CAST_TYPE={raw!r} is not a Neuron cast type",
            f"use one of {', '.join(CAST_TYPES)}",
        )
    return cast


def neuron_shape(facts: ModelFacts, env: Mapping[str, str], values: dict[str, Any]) -> StaticShape:
    """The Neuron static shape: from the compiled model, else from HF_* (export at start-up)."""
    env_batch, env_seq = env_int(env, "HF_BATCH_SIZE"), env_int(env, "HF_SEQUENCE_LENGTH")
    env_cores, env_cast = env_int(env, "HF_NUM_CORES"), _cast_from_env(env)
    export = facts.neuron
    if export is not None:
        for env_name, env_value, model_value, key in (
            ("HF_BATCH_SIZE", env_batch, export.batch_size, "batch_size"),
            ("HF_SEQUENCE_LENGTH", env_seq, export.sequence_length, "sequence_length"),
            ("HF_NUM_CORES", env_cores, export.num_cores, "num_cores"),
            ("HF_AUTO_CAST_TYPE", env_cast, export.auto_cast_type, "auto_cast_type"),
        ):
            if env_value is not None and model_value is not None and env_value != model_value:
                raise ConfigError(
                    f"{env_name}={env_value} does not match the compiled model's "
                    f"{key}={model_value} ({export.source})",
                    f"unset {env_name}, or re-export the model with tgis export-neuron",
                )
        return StaticShape(
            export.batch_size,
            export.sequence_length,
            export.num_cores,
            export.auto_cast_type,
            export.source,
        )
    # Not exported yet: the shape it will be compiled for at start-up.
    batch = env_batch or values["max_batch_size"] or NEURON_DEFAULT_BATCH_SIZE
    max_pos = facts.max_position_embeddings
    default_seq = min(max_pos, NEURON_DEFAULT_SEQUENCE_LENGTH) if max_pos else None
    seq = env_seq or values["max_total_tokens"] or default_seq or NEURON_DEFAULT_SEQUENCE_LENGTH
    cores = env_cores or values["num_shard"] or NEURON_DEFAULT_NUM_CORES
    return StaticShape(
        batch, seq, cores, env_cast or NEURON_DEFAULT_CAST, "export parameters (HF_* / flags)"
    )


def tpu_shape(
    facts: ModelFacts, env: Mapping[str, str], values: dict[str, Any], r: Sources
) -> StaticShape:
    """The TPU static shape: HF_BATCH_SIZE x HF_SEQUENCE_LENGTH, else the flags, else defaults."""
    batch = env_int(env, "HF_BATCH_SIZE")
    if batch is None:
        batch = values["max_batch_size"]
        if batch is None and r.given("max_concurrent_requests"):
            batch = values["max_concurrent_requests"]
    seq = env_int(env, "HF_SEQUENCE_LENGTH") or values["max_total_tokens"]
    if seq is None:
        max_pos = facts.max_position_embeddings
        seq = min(max_pos, TPU_DEFAULT_SEQUENCE_LENGTH) if max_pos else TPU_DEFAULT_SEQUENCE_LENGTH
    return StaticShape(
        batch or TPU_DEFAULT_BATCH_SIZE, seq, None, None, "HF_BATCH_SIZE / HF_SEQUENCE_LENGTH"
    )


def _shape_label(backend: str, shape: StaticShape, what: str) -> str:
    env = {"batch": "HF_BATCH_SIZE", "length": "HF_SEQUENCE_LENGTH"}[what]
    value = shape.batch_size if what == "batch" else shape.sequence_length
    name = "batch size" if what == "batch" else "sequence length (max_length)"
    origin = (
        shape.source
        if backend == "neuron" and shape.source.startswith(("config", "neuron"))
        else env
    )
    return f"the static {name} {value} ({origin})"


def apply_static_rules(
    backend: str,
    values: dict[str, Any],
    r: Sources,
    facts: ModelFacts,
    env: Mapping[str, str],
    dtype: str | None,
    notes: list[str],
) -> tuple[StaticShape, str | None]:
    """Derive unset limits from the static shape and check set ones against it."""
    shape = (
        neuron_shape(facts, env, values)
        if backend == "neuron"
        else tpu_shape(facts, env, values, r)
    )
    batch, length = shape.batch_size, shape.sequence_length
    fix_shape = (
        "re-export the model with tgis export-neuron"
        if backend == "neuron"
        else "or change HF_BATCH_SIZE / HF_SEQUENCE_LENGTH"
    )

    def require(name: str, expected: int, why: str) -> None:
        if values[name] is None or (name == "max_concurrent_requests" and not r.given(name)):
            values[name] = expected
        elif values[name] != expected:
            raise ConfigError(
                f"{r.label(name, values[name])} must equal {why} on the {backend} backend",
                f"set {flag(name)} {expected}, {fix_shape}",
            )

    require("max_batch_size", batch, _shape_label(backend, shape, "batch"))
    if backend == "tpu":
        require("max_concurrent_requests", batch, _shape_label(backend, shape, "batch"))
    require(
        "max_total_tokens", length, _shape_label(backend, shape, "length") + " (it is per request)"
    )

    if values["max_input_tokens"] is None:
        # Neuron's entrypoint leaves half the window for the prompt; TPU all but one token.
        values["max_input_tokens"] = length // 2 if backend == "neuron" else length - 1
    elif values["max_input_tokens"] >= length:
        raise ConfigError(
            f"{r.label('max_input_tokens', values['max_input_tokens'])} must be lower than "
            f"{_shape_label(backend, shape, 'length')}",
            f"set --max-input-tokens {length - 1} or less",
        )

    prefill = batch * values["max_input_tokens"]
    if values["max_batch_prefill_tokens"] is None:
        values["max_batch_prefill_tokens"] = prefill
    elif values["max_batch_prefill_tokens"] != prefill:
        message = (
            f"{r.label('max_batch_prefill_tokens', values['max_batch_prefill_tokens'])} should be "
            f"batch_size x max_input_tokens = {batch} x {values['max_input_tokens']} = {prefill}"
        )
        if backend == "tpu":
            raise ConfigError(
                message.replace("should be", "must be"), f"set --max-batch-prefill-tokens {prefill}"
            )
        notes.append(f"{message} for efficient prefill (set --max-batch-prefill-tokens {prefill})")

    require(
        "max_batch_total_tokens",
        shape.max_tokens,
        f"batch_size x max_length = {batch} x {length} = {shape.max_tokens}",
    )

    if backend == "neuron":
        if (
            values["num_shard"] is not None
            and shape.num_cores
            and values["num_shard"] != shape.num_cores
        ):
            raise ConfigError(
                f"{r.label('num_shard', values['num_shard'])} does not match the {shape.num_cores} "
                f"Neuron cores the model is compiled for ({shape.source})",
                f"set --num-shard {shape.num_cores} or drop it",
            )
        values["num_shard"] = shape.num_cores
        cast_dtype = CAST_TO_DTYPE.get(shape.auto_cast_type or "")
        if dtype is not None and cast_dtype is not None and dtype != cast_dtype:
            raise ConfigError(
                f"--dtype {dtype} does not match the model's auto_cast_type {shape.auto_cast_type} "
                f"({shape.source})",
                f"set --dtype {cast_dtype} or drop it",
            )
        dtype = dtype or cast_dtype
    return shape, dtype
