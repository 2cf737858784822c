"""The top of the validation core: launcher flags + environment + model facts -> ServeConfig.

Every stage (serve, warmup, export-neuron) builds its limits here, so one rule set holds
everywhere. Each violation raises ConfigError naming the offending values, where each came
from, and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields

from tgis.config.dtypes import normalize_dtype
from tgis.config.env import DEFAULTS, Sources, default_env, env_bool, env_value, model_reference
from tgis.config.gaudi import check_gaudi_variables_unused, gaudi_settings
from tgis.config.model import ModelFacts
from tgis.config.rules import (
    check_backend_options,
    check_sharding,
    check_token_limits,
    check_value_ranges,
    derive_dynamic_defaults,
)
from tgis.config.static import apply_static_rules
from tgis.config.types import BACKENDS, STATIC_BACKENDS, LauncherArgs, ServeConfig
from tgis.errors import ConfigError

# `--backend auto`: (model facts, PJRT_DEVICE or None) -> a backend name.
DetectBackend = Callable[[ModelFacts, str | None], str]


def build_serve_config(
    args: LauncherArgs,
    facts: ModelFacts,
    env: Mapping[str, str] | None = None,
    detect_backend: DetectBackend | None = None,
) -> ServeConfig:
    """Resolve flags, environment and model facts into a validated ServeConfig.

    `detect_backend` resolves `--backend auto` (see tgis.backends.registry); without it,
    auto means neuron for a Neuron-exported model and cpu otherwise.
    """
    env = default_env() if env is None else env
    r = Sources(args, env)
    values = {f.name: r.get(f.name) for f in fields(LauncherArgs)}
    notes: list[str] = []

    backend = (values["backend"] or DEFAULTS["backend"]).lower()
    if backend not in BACKENDS:
        raise ConfigError(
            f"--backend {backend!r} is not a backend", f"use one of {', '.join(BACKENDS)}"
        )
    if backend == "auto":
        backend = (
            detect_backend(facts, env_value(env, "PJRT_DEVICE"))
            if detect_backend
            else ("neuron" if facts.neuron else "cpu")
        )
    if facts.neuron is not None and backend != "neuron":
        raise ConfigError(
            f"the model was exported for Neuron ({facts.neuron.source}) but --backend is {backend}",
            "serve it with --backend neuron, or use the original (non-Neuron) checkpoint",
        )

    if values["max_input_tokens"] is not None and values["max_input_length"] is not None:
        raise ConfigError(
            "both --max-input-tokens and its alias --max-input-length are set",
            "keep one of them (MAX_INPUT_TOKENS / MAX_INPUT_LENGTH in the environment count too)",
        )
    if values["max_input_tokens"] is None and values["max_input_length"] is not None:
        values["max_input_tokens"] = values["max_input_length"]
        r.origin["max_input_tokens"] = r.origin["max_input_length"]

    dtype = normalize_dtype(values["dtype"], r.label("dtype", values["dtype"]).split(" ")[0])
    check_value_ranges(values, r)

    static = None
    if backend in STATIC_BACKENDS:
        static, dtype = apply_static_rules(backend, values, r, facts, env, dtype, notes)
    else:
        derive_dynamic_defaults(values, facts.max_position_embeddings, notes)
    check_token_limits(values, r, facts.max_position_embeddings)
    if backend == "gaudi":
        gaudi = gaudi_settings(env, values, notes)
    else:
        check_gaudi_variables_unused(backend, env)
        gaudi = None
    num_shard = check_sharding(backend, values, r)
    prefill_mode = check_backend_options(backend, values, r)

    model_id, revision = model_reference(args, env)
    return ServeConfig(
        model_id=model_id,
        revision=revision,
        backend=backend,
        dtype=dtype,
        num_shard=num_shard,
        port=values["port"] or DEFAULTS["port"],
        hostname=values["hostname"] or DEFAULTS["hostname"],
        max_concurrent_requests=values["max_concurrent_requests"],
        max_best_of=values["max_best_of"],
        max_stop_sequences=values["max_stop_sequences"],
        max_top_n_tokens=values["max_top_n_tokens"],
        max_input_tokens=values["max_input_tokens"],
        max_total_tokens=values["max_total_tokens"],
        max_batch_prefill_tokens=values["max_batch_prefill_tokens"],
        max_batch_total_tokens=values["max_batch_total_tokens"],
        max_batch_size=values["max_batch_size"],
        max_waiting_tokens=values["max_waiting_tokens"],
        waiting_served_ratio=values["waiting_served_ratio"],
        warmup_enabled=env_bool(env, "WARMUP_ENABLED", True),
        static_shape=static,
        gaudi=gaudi,
        api_key=values["api_key"] or None,
        cors_allow_origins=tuple(
            o.strip() for o in (values["cors_allow_origin"] or "").split(",") if o.strip()
        ),
        prefill_mode=prefill_mode,
        compile_cache=values["compile_cache"] or None,
        compile=bool(values["compile"]),
        cuda_graphs=values["cuda_graphs"],
        prefix_caching=values["prefix_caching"],
        cuda_memory_fraction=values["cuda_memory_fraction"],
        notes=tuple(notes),
    )
