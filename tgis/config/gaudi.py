"""Gaudi bucketing settings (seed 003's environment table), validated and explained.

Gaudi runs HPU graphs per shape, so batch sizes and prompt lengths are rounded up to
buckets: each bucket is a graph to compile at warmup and to keep in device memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tgis.config.env import env_int, env_value
from tgis.config.parse import parse_bool
from tgis.config.types import GaudiSettings, round_up
from tgis.errors import ConfigError

_INTS = {
    "BATCH_BUCKET_SIZE": "batch_bucket_size",
    "PREFILL_BATCH_BUCKET_SIZE": "prefill_batch_bucket_size",
    "PAD_SEQUENCE_TO_MULTIPLE_OF": "pad_sequence_to_multiple_of",
}
_COUNTS = {
    "QUEUE_THRESHOLD_MS": "queue_threshold_ms",
    "PROF_WAITSTEP": "prof_waitstep",
    "PROF_WARMUPSTEP": "prof_warmupstep",
    "PROF_STEP": "prof_step",
}
_BOOLS = {
    "ENABLE_HPU_GRAPH": "enable_hpu_graph",
    "LIMIT_HPU_GRAPH": "limit_hpu_graph",
    "SKIP_TOKENIZER_IN_TGI": "skip_tokenizer_in_tgi",
    "USE_FLASH_ATTENTION": "use_flash_attention",
    "FLASH_ATTENTION_RECOMPUTE": "flash_attention_recompute",
    "PROF_RECORD_SHAPES": "prof_record_shapes",
}


# Seed 003's variables: they configure the gaudi backend and nothing else.
GAUDI_VARIABLES = (
    *_INTS,
    *_COUNTS,
    *_BOOLS,
    "PROF_PATH",
    "PROF_RANKS",
    "QUANT_CONFIG",
)


def check_gaudi_variables_unused(backend: str, env: Mapping[str, str]) -> None:
    """Seed 003's variables set for another backend would be ignored: refuse them."""
    given = [name for name in GAUDI_VARIABLES if env_value(env, name) is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)} {'configures' if len(given) == 1 else 'configure'} the gaudi "
            f"backend (seed 003's settings), but the backend is {backend}",
            f"unset {', '.join(given)}, or serve with --backend gaudi",
        )


def gaudi_settings(
    env: Mapping[str, str], values: dict[str, Any], notes: list[str]
) -> GaudiSettings:
    """Read seed 003's variables, derive the bucket sizes from the limits, and check them."""
    kw: dict[str, Any] = {}
    for names, minimum in ((_INTS, 1), (_COUNTS, 0)):
        for name, key in names.items():
            if (number := env_int(env, name, minimum)) is not None:
                kw[key] = number
    for name, key in _BOOLS.items():
        if (raw := env_value(env, name)) is not None:
            kw[key] = parse_bool(name, raw)
    for name, key in (("PROF_PATH", "prof_path"), ("QUANT_CONFIG", "quant_config")):
        if (raw := env_value(env, name)) is not None:
            kw[key] = raw
    if (ranks := env_value(env, "PROF_RANKS")) is not None:
        try:
            kw["prof_ranks"] = tuple(int(x) for x in ranks.split(","))
        except ValueError:
            raise ConfigError(
                f"PROF_RANKS={ranks!r} is not a comma-separated list of ranks",
                "use e.g. PROF_RANKS=0,1",
            ) from None
    # The HPU runtime's own variables, read here so the backend gets them from the settings.
    kw["rank"] = env_int(env, "RANK", minimum=0) or 0
    kw["lazy_mode"] = (env_value(env, "PT_HPU_LAZY_MODE") or "1") != "0"
    base = GaudiSettings(**kw)
    if base.skip_tokenizer_in_tgi:
        raise ConfigError(
            "SKIP_TOKENIZER_IN_TGI=true asks for requests and responses made of token ids, "
            "which tgis's HTTP APIs do not take: the server always tokenizes",
            "unset SKIP_TOKENIZER_IN_TGI (or set it to false)",
        )

    max_input = values["max_input_tokens"]
    pad = base.pad_sequence_to_multiple_of
    if pad > max_input:
        raise ConfigError(
            f"PAD_SEQUENCE_TO_MULTIPLE_OF={pad} cannot be higher than --max-input-tokens {max_input}: "
            "every prompt would be padded past the longest allowed prompt",
            f"set PAD_SEQUENCE_TO_MULTIPLE_OF to {max_input} or less, or raise --max-input-tokens",
        )
    requested = values["max_batch_size"] or values["max_concurrent_requests"]
    decode_batch = round_up(requested, base.batch_bucket_size)
    if values["max_batch_size"] is not None and decode_batch != values["max_batch_size"]:
        notes.append(
            f"gaudi: --max-batch-size {values['max_batch_size']} is padded to {decode_batch} "
            f"(a multiple of BATCH_BUCKET_SIZE={base.batch_bucket_size}); "
            f"set --max-batch-size {decode_batch} to use the padding slots"
        )
    # A prefill batch holds as many longest prompts as the prefill budget allows, at most a
    # decode batch, rounded up to its bucket.
    fits = max(1, min(values["max_batch_prefill_tokens"] // max_input, decode_batch))
    prefill_batch = round_up(fits, base.prefill_batch_bucket_size)
    settings = GaudiSettings(
        **{
            **base.__dict__,
            "decode_batch_size": decode_batch,
            "prefill_batch_size": prefill_batch,
            "max_input_tokens": max_input,
        }
    )
    notes.append(
        f"gaudi: prefill batches padded to multiples of {settings.prefill_batch_bucket_size} "
        f"(up to {min(prefill_batch, decode_batch)}), prompts to multiples of {pad} (up to {max_input}); warmup covers {len(settings.prefill_buckets)} prefill "
        f"and {len(settings.decode_buckets)} decode buckets"
        + ("" if settings.enable_hpu_graph else "; HPU graphs disabled (ENABLE_HPU_GRAPH=false)")
        + (
            "; prefill runs without HPU graphs (LIMIT_HPU_GRAPH)"
            if settings.enable_hpu_graph and settings.limit_hpu_graph
            else ""
        )
    )
    return settings
