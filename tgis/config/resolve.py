"""The top of the validation core: launcher flags + environment + model facts -> ServeConfig.

Every stage (serve, warmup, export-neuron) builds its limits here, so one rule set holds
everywhere. Each violation raises ConfigError naming the offending values, where each came
from, and the fix.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from tgis.config.dtypes import normalize_dtype
from tgis.config.env import (
    ALIASES,
    DEFAULTS,
    ENV_NAMES,
    Sources,
    default_env,
    env_bool,
    env_value,
    model_reference,
)
from tgis.config.gaudi import check_gaudi_variables_unused, gaudi_settings
from tgis.config.model import ModelFacts
from tgis.config.parse import flag
from tgis.config.rules import (
    attention_backend,
    check_async_scheduling,
    check_backend_options,
    check_draft_model,
    check_sharding,
    check_token_limits,
    check_value_ranges,
    derive_dynamic_defaults,
    kv_cache_dtype,
    lora_settings,
    model_impl,
    quantization,
)
from tgis.config.static import apply_static_rules
from tgis.config.types import (
    BACKENDS,
    BITSANDBYTES_METHODS,
    STATIC_BACKENDS,
    LauncherArgs,
    ServeConfig,
    TlsFiles,
)
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
    if facts.encoder_decoder and backend not in ("cpu", "cuda"):
        raise ConfigError(
            f"{facts.model_type or 'this model'} is an encoder-decoder model; the {backend} "
            "backend serves decoder-only models (its compiled graphs have no encoder)",
            "serve encoder-decoder models with --backend cpu or cuda",
        )
    if facts.neuron is not None and backend != "neuron":
        raise ConfigError(
            f"the model was exported for Neuron ({facts.neuron.source}) but --backend is {backend}",
            "serve it with --backend neuron, or use the original (non-Neuron) checkpoint",
        )

    apply_aliases(values, r)

    dtype = normalize_dtype(values["dtype"], r.label("dtype", values["dtype"]).split(" ")[0])
    check_value_ranges(values, r)

    static = None
    if backend in STATIC_BACKENDS:
        static, dtype = apply_static_rules(backend, values, r, facts, env, dtype, notes)
    else:
        pooling = facts.pooling or bool(values["rerank_tokens"])  # a yes/no reranker pools too
        derive_dynamic_defaults(values, facts.max_position_embeddings, notes, pooling)
    check_token_limits(values, r, facts.max_position_embeddings)
    if backend == "gaudi":
        gaudi = gaudi_settings(env, values, notes)
    else:
        check_gaudi_variables_unused(backend, env)
        gaudi = None
    num_shard = check_sharding(backend, values, r)
    check_draft_model(values, r, num_shard)
    check_async_scheduling(values, r)
    lora_adapters, lora_adapter_dir, max_loras, max_lora_rank = lora_settings(values, r)
    prefill_mode = check_backend_options(backend, values, r)
    impl = model_impl(backend, values, r)
    attention = attention_backend(backend, values, r)
    quantize, group_size, from_checkpoint = quantization(backend, values, r, facts.config)
    kv_dtype = kv_cache_dtype(backend, values, r)
    warmup_enabled = env_bool(env, "WARMUP_ENABLED", True)
    if values["cuda_graphs"] and not warmup_enabled:
        raise ConfigError(
            f"{r.label('cuda_graphs', 'true')}: decode graphs are recorded at warmup, which "
            "WARMUP_ENABLED=false skips, so decode would run eagerly",
            "drop --cuda-graphs (TGIS_CUDA_GRAPHS), or enable warmup",
        )
    if values["compile"] and not warmup_enabled:
        raise ConfigError(
            f"{r.label('compile', 'true')}: decode graphs are compiled at warmup, which "
            "WARMUP_ENABLED=false skips, so decode would run eagerly",
            "drop --compile (TGIS_COMPILE), or enable warmup",
        )
    if values["compile_cache"] and values["compile"] is None and backend == "cpu":
        off = (
            "WARMUP_ENABLED=false skips warmup, where they are built and loaded"
            if not warmup_enabled
            else f"{r.label('quantize', quantize)}'s weights are not ones its graphs take"
            if quantize in BITSANDBYTES_METHODS
            else f"{r.label('num_shard', num_shard)} shards the model"
            if num_shard > 1
            else None
        )
        if off is not None:
            raise ConfigError(
                f"{r.label('compile_cache', values['compile_cache'])} keeps the compiled "
                f"decode's packages, and here decode stays eager: {off}",
                "drop --compile-cache (TGIS_COMPILE_CACHE)",
            )

    model_id, revision = model_reference(args, env)
    sources = tuple(
        (name, spelled)
        for name in (f.name for f in fields(LauncherArgs))
        if name not in ALIASES and (spelled := r.spelled(name)) is not None
    )
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
        warmup_enabled=warmup_enabled,
        static_shape=static,
        gaudi=gaudi,
        api_key=values["api_key"] or None,
        cors_allow_origins=tuple(
            o.strip() for o in (values["cors_allow_origin"] or "").split(",") if o.strip()
        ),
        playground=values["playground"] is not False,
        allow_image_urls=bool(values["allow_image_urls"]),
        max_images_per_request=DEFAULTS["max_images_per_request"]
        if values["max_images_per_request"] is None
        else values["max_images_per_request"],
        max_image_pixels=values["max_image_pixels"] or DEFAULTS["max_image_pixels"],
        max_image_bytes=values["max_image_bytes"] or DEFAULTS["max_image_bytes"],
        prefill_mode=prefill_mode,
        model_impl=impl,
        attention_backend=attention,
        quantize=quantize,
        quantize_group_size=group_size,
        quantized_checkpoint=from_checkpoint,
        kv_cache_dtype=kv_dtype,
        compile_cache=values["compile_cache"] or None,
        compile=values["compile"],
        cuda_graphs=values["cuda_graphs"],
        async_scheduling=values["async_scheduling"],
        prefix_caching=values["prefix_caching"],
        cuda_memory_fraction=values["cuda_memory_fraction"],
        speculate=values["speculate"] or 0,
        draft_model=values["draft_model"] or None,
        rerank_tokens=tuple(values["rerank_tokens"].split(",")) if values["rerank_tokens"] else (),
        rerank_template=values["rerank_template"] or None,
        lora_adapters=lora_adapters,
        lora_adapter_dir=lora_adapter_dir,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        grpc_port=grpc_port(values, r),
        max_new_tokens=values["max_new_tokens"],
        output_special_tokens=bool(values["output_special_tokens"]),
        default_include_stop_seqs=values["default_include_stop_seqs"] is not False,
        tls=tls_files(values, r),
        prefix_store_path=values["prefix_store_path"],
        master_addr=values["master_addr"] or DEFAULTS["master_addr"],
        master_port=values["master_port"] or DEFAULTS["master_port"],
        nnodes=values["nnodes"] or DEFAULTS["nnodes"],
        node_rank=values["node_rank"] or DEFAULTS["node_rank"],
        socket_ifname=values["socket_ifname"] or None,
        join_timeout_s=values["join_timeout_s"] or DEFAULTS["join_timeout_s"],
        node_timeout_s=values["node_timeout_s"] or DEFAULTS["node_timeout_s"],
        max_request_body_bytes=values["max_request_body_bytes"]
        or DEFAULTS["max_request_body_bytes"],
        max_stored_responses=DEFAULTS["max_stored_responses"]
        if values["max_stored_responses"] is None
        else values["max_stored_responses"],
        header_timeout_s=values["header_timeout_s"] or DEFAULTS["header_timeout_s"],
        body_timeout_s=values["body_timeout_s"] or DEFAULTS["body_timeout_s"],
        keep_alive_timeout_s=values["keep_alive_timeout_s"] or DEFAULTS["keep_alive_timeout_s"],
        notes=tuple(notes),
        sources=sources,
    )


def apply_aliases(values: dict[str, Any], r: Sources) -> None:
    """Move each alias's value (TGIS's and TGI 1.x's names) to the field it names, keeping
    the name that set it; both names of one setting is an error."""
    for alias, name in ALIASES.items():
        if values[alias] is None:
            continue
        if values[name] is not None:
            raise ConfigError(
                f"both {r.spelled(name)} and {r.spelled(alias)} are set: they are one setting",
                f"keep one of them ({flag(name)} / {ENV_NAMES[name]}, "
                f"{flag(alias)} / {ENV_NAMES[alias]})",
            )
        values[name] = values[alias]
        r.origin[name] = r.origin[alias]
        r.names[name] = r.spelled(alias) or flag(alias)


def grpc_port(values: dict[str, Any], r: Sources) -> int | None:
    """The gRPC port (TGIS's 8033 by default), or None with --no-grpc."""
    if values["grpc"] is False:
        if values["grpc_port"] is not None:
            raise ConfigError(
                f"{r.label('grpc_port', values['grpc_port'])} is set but gRPC is off "
                f"({r.spelled('grpc')})",
                "drop one of them",
            )
        return None
    port = values["grpc_port"] if values["grpc_port"] is not None else DEFAULTS["grpc_port"]
    http_port = values["port"] or DEFAULTS["port"]
    if not 0 < port < 65536 or port == http_port:
        raise ConfigError(
            f"{r.label('grpc_port', port)} must be a port from 1 to 65535 other than the "
            f"HTTP port ({http_port})",
            "pick another --grpc-port, or --no-grpc to serve HTTP only",
        )
    return int(port)


def tls_files(values: dict[str, Any], r: Sources) -> TlsFiles | None:
    """The TLS files, each checked readable; a key without a certificate (or the reverse),
    or a client CA without both, is an error."""
    names = ("tls_cert_path", "tls_key_path", "tls_client_ca_cert_path")
    cert, key, client_ca = (values[n] for n in names)
    if cert is None and key is None and client_ca is None:
        return None
    if cert is None or key is None:
        missing = "tls_cert_path" if cert is None else "tls_key_path"
        raise ConfigError(
            f"TLS needs both a certificate and its key; {flag(missing)} is not set",
            f"set {flag(missing)} ({ENV_NAMES[missing]}) too",
        )
    for name in names:
        path = values[name]
        if path is None:
            continue
        try:
            with open(path, "rb") as handle:
                handle.read(1)
        except OSError as exc:
            raise ConfigError(
                f"{r.label(name, path)}: cannot read it ({exc.strerror or exc})",
                f"point {flag(name)} at a readable PEM file",
            ) from None
    check_tls_contents(cert, key, client_ca, r)
    return TlsFiles(cert, key, client_ca)


def check_tls_contents(cert: str, key: str, client_ca: str | None, r: Sources) -> None:
    """The certificate and key must be PEM and belong together, the client CA must be PEM
    certificates: found here rather than as a failed listen on the gRPC port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{r.label('tls_cert_path', cert)} with {r.label('tls_key_path', key)}: not a PEM "
            f"certificate and its private key ({exc.reason or exc})",
            "give the server's certificate and the key it was issued for, both in PEM",
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{r.label('tls_client_ca_cert_path', client_ca)}: not PEM CA certificates "
                f"({exc.reason or exc})",
                "give the CA certificate(s) that sign client certificates, in PEM",
            ) from None
