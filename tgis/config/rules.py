"""The rules every backend shares (TGI launcher semantics), each in one place.

Called by tgis.config.resolve while it builds a ServeConfig, and by the service once the
backend has measured its KV budget (`check_kv_budget`). Per-backend shape rules are in
tgis.config.static (tpu, neuron) and tgis.config.gaudi.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tgis.config.checkpoint_quant import CheckpointQuant
from tgis.config.env import DEFAULTS, Sources
from tgis.config.parse import flag
from tgis.config.types import (
    ADAPTER_NAME,
    BITSANDBYTES_METHODS,
    DEFAULT_QUANTIZE_GROUP_SIZE,
    KV_CACHE_ALIASES,
    KV_CACHE_DTYPES,
    MAX_SPECULATE,
    PREFILL_MODES,
    QUANTIZE_GROUP_SIZES,
    QUANTIZE_METHODS,
    STATIC_BACKENDS,
    ServeConfig,
)
from tgis.errors import ConfigError

# TGI caps the default context at 4096 tokens to leave room for more concurrent users.
DEFAULT_MAX_TOTAL_CAP = 4096
# TGI's slack on the default prefill budget, for block-size alignment.
PREFILL_EDGE = 50


def check_value_ranges(values: dict[str, Any], r: Sources) -> None:
    """Fill TGI's plain defaults and check each value on its own (counts, ratios)."""
    for name in (
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_top_n_tokens",
    ):
        if values[name] is None:
            values[name] = DEFAULTS[name]
    for name in (
        "max_concurrent_requests",
        "max_best_of",
        "max_input_tokens",
        "max_total_tokens",
        "max_batch_prefill_tokens",
        "max_batch_total_tokens",
        "max_batch_size",
        "num_shard",
        "nnodes",
        "port",
        "max_new_tokens",
        "max_request_body_bytes",
        "max_image_pixels",
        "max_image_bytes",
    ):
        if values[name] is not None and values[name] < 1:
            raise ConfigError(
                f"{r.label(name, values[name])} must be >= 1",
                f"set {flag(name)} to a positive value",
            )
    for name in (
        "max_stop_sequences",
        "max_top_n_tokens",
        "max_waiting_tokens",
        "max_stored_responses",
        "max_images_per_request",
        "node_rank",
    ):
        if values[name] is not None and values[name] < 0:
            raise ConfigError(
                f"{r.label(name, values[name])} must be >= 0", f"set {flag(name)} to 0 or more"
            )
    if values["waiting_served_ratio"] is not None and values["waiting_served_ratio"] <= 0:
        raise ConfigError(
            f"{r.label('waiting_served_ratio', values['waiting_served_ratio'])} must be > 0",
            "use a ratio such as 0.3 (TGI's default) or 1.2",
        )
    speculate = values["speculate"]
    if speculate is not None and not 0 <= speculate <= MAX_SPECULATE:
        raise ConfigError(
            f"{r.label('speculate', speculate)} must be in [0, {MAX_SPECULATE}]",
            f"set {flag('speculate')} to the draft tokens to verify per step, such as 4 (0: off)",
        )
    for name in (
        "header_timeout_s",
        "body_timeout_s",
        "keep_alive_timeout_s",
        "join_timeout_s",
        "node_timeout_s",
    ):
        seconds = values[name]
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise ConfigError(
                f"{r.label(name, seconds)} must be a positive number of seconds",
                f"set {flag(name)} to seconds such as {DEFAULTS[name]:g} (the default)",
            )


# A pooling model's batch budget when none is given: TEI's --max-batch-tokens default (its
# forward keeps no KV, so a batch is bounded by its activations only).
POOLING_BATCH_TOKENS = 16384


def derive_dynamic_defaults(
    values: dict[str, Any], max_positions: int | None, notes: list[str], pooling: bool = False
) -> None:
    """TGI's launcher defaults for dynamic-shape backends (cpu, cuda, gaudi); a pooling
    model's batch budget is TEI's (POOLING_BATCH_TOKENS)."""
    if values["max_total_tokens"] is None:
        cap = DEFAULT_MAX_TOTAL_CAP
        default = cap if max_positions is None else min(max_positions, cap)
        if values["max_input_tokens"] is not None:
            # Room for at least one new token, within what the model can address.
            wanted = max(default, values["max_input_tokens"] + 1)
            default = wanted if max_positions is None else min(wanted, max_positions)
        elif max_positions is not None and max_positions > cap:
            notes.append(
                f"the model supports {max_positions} positions; the default context is "
                f"{cap} to leave memory for more users "
                f"(raise it with --max-total-tokens {max_positions} --max-input-tokens "
                f"{max_positions - 1} --max-batch-prefill-tokens {max_positions + PREFILL_EDGE})"
            )
        values["max_total_tokens"] = default
    if values["max_input_tokens"] is None:
        values["max_input_tokens"] = values["max_total_tokens"] - 1
    if values["max_batch_prefill_tokens"] is None:
        if pooling:
            values["max_batch_prefill_tokens"] = max(
                POOLING_BATCH_TOKENS, values["max_input_tokens"]
            )
        elif values["max_batch_size"] is not None:
            values["max_batch_prefill_tokens"] = (
                values["max_batch_size"] * values["max_input_tokens"]
            )
        else:
            values["max_batch_prefill_tokens"] = values["max_input_tokens"] + PREFILL_EDGE


def check_token_limits(values: dict[str, Any], r: Sources, max_positions: int | None) -> None:
    """The per-request limits against each other, the model and the batch budgets.

    Together they guarantee that every request tgis.params.validate admits fits one prefill
    step and the KV budget, so the scheduler never holds a request it cannot run.
    """
    mi, mt = values["max_input_tokens"], values["max_total_tokens"]
    prefill, total = values["max_batch_prefill_tokens"], values["max_batch_total_tokens"]
    if mi >= mt:
        raise ConfigError(
            f"{r.label('max_input_tokens', mi)} must be < {r.label('max_total_tokens', mt)}",
            f"lower --max-input-tokens to at most {mt - 1}, or raise --max-total-tokens above {mi}",
        )
    if max_positions is not None and mt > max_positions:
        raise ConfigError(
            f"{r.label('max_total_tokens', mt)} exceeds the model's {max_positions} positions "
            "(max_position_embeddings in its config.json)",
            f"set --max-total-tokens {max_positions} or less",
        )
    if prefill < mi:
        raise ConfigError(
            f"{r.label('max_batch_prefill_tokens', prefill)} must be >= "
            f"{r.label('max_input_tokens', mi)}: a prompt of the maximum length could never be prefilled",
            f"set --max-batch-prefill-tokens {mi} or more",
        )
    if total is not None:
        if prefill > total:
            raise ConfigError(
                f"{r.label('max_batch_prefill_tokens', prefill)} must be <= "
                f"{r.label('max_batch_total_tokens', total)}",
                f"lower --max-batch-prefill-tokens to {total} or raise --max-batch-total-tokens",
            )
        _require_one_request_fits(
            mt,
            r.label("max_total_tokens", mt),
            total,
            r.label("max_batch_total_tokens", total),
            "--max-batch-total-tokens",
        )


def check_kv_budget(config: ServeConfig, capacity_tokens: int) -> int:
    """The KV budget the engine schedules with: --max-batch-total-tokens, at most what the
    loaded backend holds (`capacity_tokens`). One full-length request must fit in it."""
    budget = min(config.max_batch_total_tokens or capacity_tokens, capacity_tokens)
    _require_one_request_fits(
        config.max_total_tokens,
        f"--max-total-tokens {config.max_total_tokens}",
        budget,
        f"the KV cache the {config.backend} backend holds ({budget} tokens)",
        "the KV cache (free device memory, or --max-batch-total-tokens)",
    )
    return budget


def _require_one_request_fits(
    max_total: int, total_label: str, budget: int, budget_label: str, to_raise: str
) -> None:
    if max_total > budget:
        raise ConfigError(
            f"{total_label} must be <= {budget_label}: one full-length request could never fit "
            "in the batch",
            f"lower --max-total-tokens to {budget}, or raise {to_raise} to at least {max_total}",
        )


def check_sharding(backend: str, values: dict[str, Any], r: Sources) -> int:
    """The shard count: processes of tensor parallelism on cpu and cuda, the Neuron cores on
    neuron, 1 elsewhere."""
    num_shard = values["num_shard"] or 1
    sharded = values["sharded"]
    if backend in ("cpu", "cuda"):
        if sharded and num_shard == 1:
            raise ConfigError(
                f"{r.label('sharded', 'true')} but {r.label('num_shard', 1)}",
                "set --num-shard to the devices to shard over (NUM_SHARD), or drop --sharded",
            )
        if sharded is False and num_shard > 1:
            raise ConfigError(
                f"{r.label('sharded', 'false')} contradicts {r.label('num_shard', num_shard)}",
                "drop --sharded false",
            )
        port = values["master_port"]
        if port is not None and not 0 < port < 65536:
            raise ConfigError(
                f"{r.label('master_port', port)} is not a port", "use a port from 1 to 65535"
            )
        check_nodes(values, r, num_shard)
        return num_shard
    for name in ("nnodes", "node_rank"):
        if (values[name] or 0) > (1 if name == "nnodes" else 0):
            raise ConfigError(
                f"{r.label(name, values[name])}: the {backend} backend runs on one host "
                "(multi-node tensor parallelism is the cpu and cuda backends')",
                "drop --nnodes and --node-rank (NNODES, NODE_RANK)",
            )
    if backend != "neuron":
        if num_shard > 1 or sharded:
            given = r.label("num_shard", num_shard) if num_shard > 1 else r.label("sharded", "true")
            raise ConfigError(
                f"{given}: the {backend} backend runs the model on one device (--num-shard "
                "shards models on cpu and cuda, and on neuron it is the Neuron cores its model "
                "is compiled for)",
                "drop --num-shard and --sharded (NUM_SHARD, SHARDED), or set --num-shard 1",
            )
        return 1
    if sharded is False and num_shard > 1:
        raise ConfigError(
            f"{r.label('sharded', 'false')} contradicts {r.label('num_shard', num_shard)} "
            "(the Neuron cores the model runs on)",
            "drop --sharded false",
        )
    if sharded and num_shard == 1:
        raise ConfigError(
            f"{r.label('sharded', 'true')} but the model runs on one Neuron core",
            "drop --sharded, or re-export the model with tgis export-neuron --num-cores 2 or more",
        )
    return num_shard


def check_nodes(values: dict[str, Any], r: Sources, num_shard: int) -> None:
    """--nnodes K and --node-rank R: --num-shard N's ranks over K hosts, N / K on each."""
    nnodes = values["nnodes"] or 1
    node_rank = values["node_rank"] or 0
    if node_rank >= nnodes:
        raise ConfigError(
            f"{r.label('node_rank', node_rank)} is not a node of {r.label('nnodes', nnodes)}",
            f"number the nodes 0 to {nnodes - 1}: 0 where the server runs (--master-addr), "
            "1 and up on the others",
        )
    if nnodes == 1:
        return
    if num_shard % nnodes:
        raise ConfigError(
            f"{r.label('num_shard', num_shard)} does not divide over {r.label('nnodes', nnodes)}: "
            "every node runs the same number of shards",
            f"set --num-shard to a multiple of {nnodes} (the shards of one node times {nnodes})",
        )
    addr = values["master_addr"] or DEFAULTS["master_addr"]
    if _loopback(addr):
        raise ConfigError(
            f"{r.label('master_addr', addr)} is a loopback address, which the other nodes of "
            f"{r.label('nnodes', nnodes)} cannot reach",
            "set --master-addr (MASTER_ADDR) to node 0's address on the network the nodes share",
        )


def _loopback(addr: str) -> bool:
    import ipaddress

    if addr.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:  # a host name: resolved when the nodes meet
        return False


def check_async_scheduling(values: dict[str, Any], r: Sources) -> None:
    """--async-scheduling plans a step before the one in flight is handed over, so it cannot
    verify drafts that need that step's tokens (--speculate)."""
    if values["async_scheduling"] and values["speculate"]:
        raise ConfigError(
            f"{r.label('async_scheduling', 'true')} and {r.label('speculate', values['speculate'])}"
            ": drafts are proposed from the tokens of the step before, which async scheduling "
            "plans the next step without",
            "drop one of them (--speculate 0 or --no-async-scheduling)",
        )


def check_draft_model(values: dict[str, Any], r: Sources, num_shard: int) -> None:
    """--draft-model drafts for --speculate, on one device."""
    draft = values["draft_model"]
    if not draft:
        return
    if not values["speculate"]:
        raise ConfigError(
            f"{r.label('draft_model', draft)} drafts for speculative decoding, which is off "
            f"({r.label('speculate', values['speculate'] or 0)})",
            f"set {flag('speculate')} (SPECULATE) to the draft tokens per step, such as 4",
        )
    if num_shard > 1:
        raise ConfigError(
            f"{r.label('draft_model', draft)} runs on one device; {r.label('num_shard', num_shard)}"
            " shards the model over several",
            "drop --draft-model (DRAFT_MODEL) to draft by prompt lookup, or serve with "
            "--num-shard 1",
        )


def lora_settings(
    values: dict[str, Any], r: Sources
) -> tuple[tuple[tuple[str, str], ...], str | None, int, int]:
    """--lora-adapters parsed into (name, path) pairs, --lora-adapter-dir, --max-loras and
    --max-lora-rank, checked (which engine serves adapters: backends/choose.py)."""
    spec, directory = values["lora_adapters"] or "", values["lora_adapter_dir"] or None
    pairs: list[tuple[str, str]] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
        name, path = name.strip(), path.strip()
        if not re.fullmatch(ADAPTER_NAME, name) or ".." in name.split("/") or not path:
            raise ConfigError(
                f"{r.label('lora_adapters', spec)}: {entry!r} is not name=path",
                "list adapters as name=directory (or a Hub id in the cache), separated by "
                "commas; a name is letters, digits, '_', '-', '.' and '/'",
            )
        if name in (n for n, _ in pairs):
            raise ConfigError(
                f"{r.label('lora_adapters', spec)} names {name!r} twice", "give each a new name"
            )
        pairs.append((name, path))
    limits = {}
    for name in ("max_loras", "max_lora_rank"):
        limits[name] = DEFAULTS[name] if values[name] is None else values[name]
        if not 1 <= limits[name] <= 1024:
            raise ConfigError(
                f"{r.label(name, limits[name])} must be in [1, 1024]",
                f"set {flag(name)} to a count such as {DEFAULTS[name]} (the default)",
            )
    if directory is not None and not Path(directory).is_dir():
        raise ConfigError(
            f"{r.label('lora_adapter_dir', directory)} is not a directory",
            "point --lora-adapter-dir at the directory holding one directory per adapter",
        )
    return tuple(pairs), directory, limits["max_loras"], limits["max_lora_rank"]


MODEL_IMPLS = ("auto", "tgis", "transformers")
ATTENTION_BACKENDS = ("auto", "triton", "flash", "torch")


def attention_backend(backend: str, values: dict[str, Any], r: Sources) -> str | None:
    """--attention-backend, normalized: one of ATTENTION_BACKENDS, None for auto. A choice of
    the paged engine's (cpu, cuda); flash attention over KV pages is CUDA's. Whether the
    choice runs on this machine (triton installed, a torch with paged varlen_attn) is the
    backend's to say when it loads."""
    given = values["attention_backend"]
    if given is None:
        return None
    choice = given.strip().lower()
    if choice not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"{r.label('attention_backend', given)} is not an attention backend",
            f"use one of {', '.join(ATTENTION_BACKENDS)}",
        )
    if choice == "auto":
        return None
    if backend in (*STATIC_BACKENDS, "gaudi"):
        raise ConfigError(
            f"{r.label('attention_backend', given)} chooses the paged engine's attention on "
            f"the cpu and cuda backends; {backend} runs its own",
            "drop --attention-backend (TGIS_ATTENTION_BACKEND)",
        )
    if choice == "flash" and backend == "cpu":
        raise ConfigError(
            f"{r.label('attention_backend', given)}: flash attention over KV pages runs on "
            "CUDA; this is the cpu backend",
            "use --attention-backend torch or triton on a CPU, or serve with --backend cuda",
        )
    return choice


def model_impl(backend: str, values: dict[str, Any], r: Sources) -> str:
    """--model-impl, normalized: one of MODEL_IMPLS; a choice of forward is the cpu and cuda
    backends' (the static backends run their own)."""
    given = values["model_impl"]
    if given is None:
        return "auto"
    impl = given.strip().lower()
    if impl not in MODEL_IMPLS:
        raise ConfigError(
            f"{r.label('model_impl', given)} is not a model implementation",
            f"use one of {', '.join(MODEL_IMPLS)}",
        )
    if impl != "auto" and backend in (*STATIC_BACKENDS, "gaudi"):
        raise ConfigError(
            f"{r.label('model_impl', given)} chooses the forward of the cpu and cuda backends; "
            f"{backend} runs its own",
            "drop --model-impl (TGIS_MODEL_IMPL)",
        )
    return impl


def kv_cache_dtype(backend: str, values: dict[str, Any], r: Sources) -> str | None:
    """--kv-cache-dtype: a float8 pool's name, or None for the model's dtype ("auto")."""
    given = values["kv_cache_dtype"]
    if given is None:
        return None
    name = given.strip().lower()
    name = KV_CACHE_ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"{r.label('kv_cache_dtype', given)} is not a KV cache dtype",
            f"use one of {', '.join(KV_CACHE_DTYPES)} (vLLM's fp8 and fp8_e4m3 name fp8_e4m3fn)",
        )
    if name == "auto":
        return None
    if values["cuda_graphs"]:
        raise ConfigError(
            f"{r.label('kv_cache_dtype', given)} and {r.label('cuda_graphs', 'true')}: a float8 "
            "pool is read by the plain-torch attention path, and decode graphs are recorded "
            "over flash attention",
            "drop --cuda-graphs (TGIS_CUDA_GRAPHS), or --kv-cache-dtype (KV_CACHE_DTYPE)",
        )
    if backend not in ("cpu", "cuda"):
        raise ConfigError(
            f"{r.label('kv_cache_dtype', given)}: a float8 KV cache is the paged engine's pool "
            f"on the cpu and cuda backends; the {backend} backend keeps its own cache",
            "drop --kv-cache-dtype (KV_CACHE_DTYPE)",
        )
    return name


# TGI's --quantize values tgis serves another way: the value -> how.
QUANTIZE_INSTEAD = {
    "eetq": "use --quantize int8, the same method (int8 weights per output channel)",
}
# TGI's --quantize values that name formats of pre-quantized checkpoints (config.json's
# quantization_config.quant_method): detected from the checkpoint, never computed at load.
CHECKPOINT_FORMATS = ("gptq", "awq", "compressed-tensors", "marlin", "exl2")


def _checkpoint_quantization(
    backend: str, values: dict[str, Any], r: Sources, stored: CheckpointQuant
) -> tuple[str, int | None, bool]:
    """A pre-quantized checkpoint's method: --quantize may repeat it, not ask for another."""
    given, group = values["quantize"], values["quantize_group_size"]
    if given is not None and given.strip().lower() != stored.method:
        raise ConfigError(
            f"{r.label('quantize', given)} asks for another quantization of a checkpoint "
            f"config.json declares already quantized ({stored.describe()})",
            "drop --quantize (QUANTIZE): the checkpoint's quantization is read from it",
        )
    if group is not None:
        raise ConfigError(
            f"{r.label('quantize_group_size', group)}: the checkpoint's groups are stored "
            f"({stored.describe()})",
            "drop --quantize-group-size (QUANTIZE_GROUP_SIZE)",
        )
    what = f"the checkpoint's {stored.method} quantization"
    if backend not in ("cpu", "cuda"):
        raise ConfigError(
            f"{what} is loaded by the paged engine on the cpu and cuda backends; the "
            f"{backend} backend runs its own weights",
            "serve the model's float checkpoint on this backend, or use --backend cpu/cuda",
        )
    if stored.float8 and backend == "cpu":
        raise ConfigError(
            f"{what}: fp8 weights multiply through torch._scaled_mm on CUDA GPUs of compute "
            "capability 8.9 or later; a CPU has no fast float8 matmul",
            "serve it with --backend cuda, or the float checkpoint with --quantize int8 on a CPU",
        )
    return stored.method, stored.group_size, True


def quantization(
    backend: str, values: dict[str, Any], r: Sources, model_config: Mapping[str, Any]
) -> tuple[str | None, int | None, bool]:
    """--quantize and --quantize-group-size, checked against the backend and the checkpoint:
    the method in force, int4's group size, and whether the weights are read quantized from a
    pre-quantized checkpoint (tgis.config.checkpoint_quant) rather than quantized at load."""
    stored = CheckpointQuant.of(model_config)
    if stored is not None:
        return _checkpoint_quantization(backend, values, r, stored)
    given, group = values["quantize"], values["quantize_group_size"]
    method = given.strip().lower() if given is not None else None
    label = r.label("quantize", given) if given is not None else None
    if method is None:
        if group is not None:
            raise ConfigError(
                f"{r.label('quantize_group_size', group)} sets int4's groups, and no "
                "--quantize is given",
                "add --quantize int4, or drop --quantize-group-size (QUANTIZE_GROUP_SIZE)",
            )
        return None, None, False
    if method in QUANTIZE_INSTEAD:
        raise ConfigError(f"{label} is not a tgis method", QUANTIZE_INSTEAD[method])
    if method in CHECKPOINT_FORMATS:
        raise ConfigError(
            f"{label} names a format of pre-quantized checkpoints, and this checkpoint's "
            "config.json declares no quantization_config",
            f"serve a {method} checkpoint (its format is detected, no flag needed), or quantize "
            f"this one at load with one of {', '.join(QUANTIZE_METHODS)}",
        )
    if method not in QUANTIZE_METHODS:
        raise ConfigError(
            f"{label} is not a quantization method", f"use one of {', '.join(QUANTIZE_METHODS)}"
        )
    if backend not in ("cpu", "cuda"):
        raise ConfigError(
            f"{label}: weights are quantized by the paged engine's forward on the cpu and cuda "
            f"backends; the {backend} backend runs its own",
            "drop --quantize (QUANTIZE)"
            + (
                ", or set QUANT_CONFIG for Intel Neural Compressor's fp8"
                if backend == "gaudi"
                else ""
            ),
        )
    if method in BITSANDBYTES_METHODS:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                f"{label} quantizes through the bitsandbytes package, which is not installed",
                "pip install 'tgis[bitsandbytes]', or use --quantize int8 or int4 (torch's "
                "own kernels)",
            )
        if values["compile"]:
            raise ConfigError(
                f"{label} and {r.label('compile', 'true')}: bitsandbytes' kernels run eagerly",
                "drop --compile (TGIS_COMPILE), or use --quantize int8 or int4",
            )
        if method == "bitsandbytes" and values["cuda_graphs"]:
            raise ConfigError(
                f"{label} and {r.label('cuda_graphs', 'true')}: LLM.int8()'s kernel finds each "
                "step's outlier columns on the host, which a graph cannot record",
                "drop --cuda-graphs (TGIS_CUDA_GRAPHS), or use --quantize bitsandbytes-nf4, "
                "int8 or int4",
            )
    if method == "fp8" and backend == "cpu":
        raise ConfigError(
            f"{label}: fp8 multiplies in float8 through torch._scaled_mm on CUDA GPUs of compute "
            "capability 8.9 or later (Ada, Hopper, Blackwell); a CPU has no fast float8 matmul",
            "use --quantize int8 or --quantize int4 on a CPU",
        )
    if method != "int4":
        if group is not None:
            raise ConfigError(
                f"{r.label('quantize_group_size', group)} sets int4's groups; {label} has none",
                "drop --quantize-group-size (QUANTIZE_GROUP_SIZE)",
            )
        return method, None, False
    if group is None:
        return method, DEFAULT_QUANTIZE_GROUP_SIZE, False
    if group not in QUANTIZE_GROUP_SIZES:
        raise ConfigError(
            f"{r.label('quantize_group_size', group)} is not an int4 group size",
            f"use one of {', '.join(map(str, QUANTIZE_GROUP_SIZES))}",
        )
    return method, group, False


def check_backend_options(backend: str, values: dict[str, Any], r: Sources) -> str | None:
    """Options that apply to some backends only; returns the normalized prefill mode."""
    prefill_mode = values["prefill_mode"]
    if prefill_mode is not None:
        prefill_mode = prefill_mode.strip().lower()
        if prefill_mode not in PREFILL_MODES:
            raise ConfigError(
                f"{r.label('prefill_mode', prefill_mode)} is not a prefill mode",
                f"use one of {', '.join(PREFILL_MODES)}",
            )
        if backend not in STATIC_BACKENDS:
            raise ConfigError(
                f"{r.label('prefill_mode', prefill_mode)} applies to the static batch of the "
                f"tpu and neuron backends, not {backend}",
                "drop --prefill-mode (TGIS_PREFILL_MODE)",
            )
    if values["compile"] and backend not in ("cpu", "cuda"):
        raise ConfigError(
            f"{r.label('compile', 'true')} applies to the cpu and cuda backends; {backend} "
            "compiles its own graphs at warmup",
            "drop --compile (TGIS_COMPILE)",
        )
    if values["cuda_graphs"]:
        if backend != "cuda":
            raise ConfigError(
                f"{r.label('cuda_graphs', 'true')} applies to the cuda backend, not {backend}",
                "drop --cuda-graphs (TGIS_CUDA_GRAPHS), or serve with --backend cuda",
            )
        if values["compile"]:
            raise ConfigError(
                f"{r.label('cuda_graphs', 'true')} and {r.label('compile', 'true')} are two "
                "ways to compile decode",
                "keep one of them",
            )
    store = values["prefix_store_path"]
    if store is not None:
        if backend not in ("cpu", "cuda"):
            raise ConfigError(
                f"{r.label('prefix_store_path', store)}: prompt prefixes need the cpu or cuda "
                f"backend; {backend}'s compiled model takes token ids only",
                "drop --prefix-store-path (PREFIX_STORE_PATH), or serve with --backend cpu/cuda",
            )
        if not Path(store).is_dir():
            raise ConfigError(
                f"{r.label('prefix_store_path', store)} is not a directory",
                "point --prefix-store-path at the directory that holds one directory per prefix",
            )
    fraction = values["cuda_memory_fraction"]
    if fraction is not None:
        if backend != "cuda":
            raise ConfigError(
                f"{r.label('cuda_memory_fraction', fraction)} applies to the cuda backend, "
                f"not {backend}",
                "drop --cuda-memory-fraction (CUDA_MEMORY_FRACTION)",
            )
        if not 0 < fraction <= 1:
            raise ConfigError(
                f"{r.label('cuda_memory_fraction', fraction)} must be in (0, 1]",
                "use a share of the GPU's memory such as 0.9",
            )
    compiles = values["compile"] or (backend == "cpu" and values["compile"] is None)
    if values["compile_cache"] and not (backend in STATIC_BACKENDS or compiles):
        raise ConfigError(
            f"{r.label('compile_cache', values['compile_cache'])} has nothing to keep on "
            f"{backend}{' with --cuda-graphs' if values['cuda_graphs'] else ''}"
            f"{' with --no-compile' if values['compile'] is False else ''}: it holds XLA "
            "programs (tpu), the start-up export (neuron), the compiled decode's packages "
            "(cpu) or torch.compile's caches (--compile on cuda)",
            "drop --compile-cache (TGIS_COMPILE_CACHE), or compile on cpu/cuda",
        )
    return prefill_mode
