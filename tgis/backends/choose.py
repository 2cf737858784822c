"""Which backend serves a model, and why: the one place that decides.

`choose_backend` reads the validated ServeConfig and the model's config.json (no weights) and
names the design that will run it, with the reason `tgis serve --check` and the start-up log
print:

- tpu / gaudi: the static batch over the llama family's fixed-shape forward; neuron: the static
  batch of the model compiled for Neuron cores (static/).
- cpu / cuda, an encoder-decoder model: the seq2seq engine (seq2seq/).
- cpu / cuda, a model of a family the paged forward runs (models/families.py): the paged engine (paged/), over
  --num-shard tensor-parallel processes when more than one.
- cpu / cuda, any other causal LM: transformers' forward over the slot cache (fallback/).
- cpu / cuda, a vision-language model (tgis.vision): its language model in the paged engine,
  with LoRA adapters and --quantize on the language model's projections; one device, and a
  float checkpoint (a pre-quantized one is refused).

It refuses, naming the setting and the fix, every option the chosen design cannot honour: the
paged engine's options (prefix caching, CUDA graphs, speculation, LoRA) anywhere else, and what
a design runs without (compiled decode on sharded or encoder-decoder steps). `load_backend`
then loads the chosen design; `tgis serve`, `tgis warmup` and `tgis benchmark --engine` all go
through both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tgis.backends.models.families import (
    STATIC_MODEL_TYPES,
    paged_unsupported_reason,
    static_unsupported_reason,
)
from tgis.config import ENV_NAMES, ModelFacts, ServeConfig
from tgis.config.checkpoint_quant import vision_checkpoint_refusal
from tgis.config.parse import flag
from tgis.config.types import BITSANDBYTES_METHODS
from tgis.errors import BackendUnavailableError, ConfigError
from tgis.vision.families import VisionFamily, text_config, vision_family_of

if TYPE_CHECKING:
    from tgis.engine.backend import Backend, PagedBackend

log = logging.getLogger("tgis.backends")

Design = Literal["paged", "fallback", "seq2seq", "static"]

# What the paged engine alone serves: setting -> what it is, for messages.
PAGED_ONLY = {
    "attention_backend": "a choice of the paged engine's attention",
    "prefix_caching": "prefix caching",
    "cuda_graphs": "CUDA graphs of decode",
    "speculate": "speculative decoding",
    "async_scheduling": "async scheduling",
    "lora_adapters": "LoRA adapters",
    "lora_adapter_dir": "LoRA adapters",
    "quantize": "weight quantization",
    "kv_cache_dtype": "a float8 KV cache",
}


@dataclass(frozen=True)
class BackendChoice:
    """The design that serves the model on `backend` (the device), and why."""

    backend: str
    design: Design
    reason: str
    # Tensor-parallel processes of the paged engine (1: one device).
    shards: int = 1

    def describe(self) -> str:
        """One line: `paged engine on cuda: ...`."""
        engine = {
            "paged": "paged engine",
            "fallback": "fallback engine (transformers' forward, slot cache)",
            "seq2seq": "seq2seq engine",
            "static": "static batch",
        }[self.design]
        shards = f" x {self.shards} shards" if self.shards > 1 else ""
        return f"{engine} on {self.backend}{shards}: {self.reason}"


def choose_backend(config: ServeConfig, facts: ModelFacts) -> BackendChoice:
    """The design serving a model of `facts` under `config`; a ConfigError for an option that
    design cannot honour."""
    kind = facts.model_type or "this model"
    if config.backend in ("tpu", "neuron", "gaudi"):
        return _static(config, facts, kind)
    if facts.encoder_decoder:
        _refuse(
            config,
            (*PAGED_ONLY, "compile", "num_shard"),
            "{given}: {what} is for decoder-only models; " + f"{kind} is an encoder-decoder one",
        )
        return BackendChoice(config.backend, "seq2seq", f"{kind} is an encoder-decoder model")
    vision = vision_family_of(facts.config)
    if vision is not None:
        return _vision(config, facts, vision)
    reason = paged_unsupported_reason(facts.config)
    impl = config.label("model_impl", config.model_impl)
    if reason is not None:
        if config.model_impl == "tgis":
            raise ConfigError(
                f"{impl}: the paged engine cannot run {kind}: {reason}",
                "drop --model-impl (TGIS_MODEL_IMPL) to serve it with transformers' forward",
            )
        why = f"the paged engine cannot run {kind}: {reason}"
    elif config.model_impl == "transformers":
        reason = why = f"{impl} asks for transformers' forward"
    if reason is not None:
        _refuse(
            config,
            (*PAGED_ONLY, "num_shard"),
            "{given}: {what} runs in the paged engine, which cannot run " + f"{kind}: {reason}",
            ", or serve a model of a family docs/models.md lists for the paged engine",
        )
        return BackendChoice(config.backend, "fallback", why)
    runs = f"the paged forward runs {kind}"
    if config.quantize is not None:
        runs = f"{runs} over {_quantized(config)} weights"
    if config.num_shard == 1:
        return BackendChoice(config.backend, "paged", runs)
    return _sharded(config, dict(facts.config), f"{runs}, tensor-parallel")


def _sharded(config: ServeConfig, model_config: dict[str, Any], runs: str) -> BackendChoice:
    """The paged engine over --num-shard processes, for the (language) model whose config.json
    is `model_config`, when its widths divide and the options run sharded."""
    from tgis.backends.paged.tensor_parallel import shard_unsupported_reason

    sharded = config.label("num_shard", config.num_shard)
    shard_reason = shard_unsupported_reason(
        model_config, config.num_shard, config.quantize_group_size
    )
    if shard_reason is not None:
        raise ConfigError(f"{sharded}: {shard_reason}", "pick one of the values named")
    _refuse(
        config,
        ("compile", "cuda_graphs", "lora_adapters", "lora_adapter_dir"),
        "{given}: {what} runs on one device; " + f"{sharded} runs sharded steps eagerly",
        ", or serve on one device (--num-shard 1)",
    )
    return BackendChoice(config.backend, "paged", runs, config.num_shard)


def _vision(config: ServeConfig, facts: ModelFacts, vision: VisionFamily) -> BackendChoice:
    """cpu / cuda, a vision-language model: its language model in the paged engine (LoRA
    adapters and --quantize apply to its projections), when its family and its language
    model's are ones tgis runs; on one device, from a float checkpoint."""
    kind = facts.model_type
    text = text_config(facts.config)
    reason = vision.refusal or paged_unsupported_reason(text)
    if reason is not None:
        raise ConfigError(
            f"tgis cannot serve {kind} yet: {reason}",
            "serve a vision-language model of a family docs/models.md lists",
        )
    if config.model_impl == "transformers":
        raise ConfigError(
            f"{config.label('model_impl', config.model_impl)}: {kind} is a vision-language "
            "model, which only the paged engine serves",
            "drop --model-impl (TGIS_MODEL_IMPL)",
        )
    if config.quantized_checkpoint:
        raise vision_checkpoint_refusal(kind, config.quantize)
    runs = f"the paged forward runs {kind}'s language model ({text.get('model_type')})"
    if config.quantize is not None:
        runs = f"{runs} over {_quantized(config)} weights (the vision tower's unquantized)"
    if config.num_shard > 1:
        runs = f"{runs}, tensor-parallel (the vision tower whole on the first shard)"
        return _sharded(config, dict(text), f"{runs}; its images: {vision.describes}")
    return BackendChoice(config.backend, "paged", f"{runs}; its images: {vision.describes}")


def _quantized(config: ServeConfig) -> str:
    """--quantize's method as the reason says it: `int4 (groups of 64)`."""
    group = f" (groups of {config.quantize_group_size})" if config.quantize_group_size else ""
    return f"{config.quantize}{group}"


def _static(config: ServeConfig, facts: ModelFacts, kind: str) -> BackendChoice:
    """tpu, neuron, gaudi: a static batch of fixed shapes."""
    if vision_family_of(facts.config) is not None:
        raise ConfigError(
            f"the {config.backend} backend serves text models; {kind} is a vision-language model",
            "serve it with --backend cpu or --backend cuda",
        )
    if config.backend == "neuron":
        reason = "optimum-neuron runs the model compiled for Neuron cores"
    else:
        refusal = static_unsupported_reason(facts.config)
        if refusal is not None:
            raise ConfigError(
                f"the {config.backend} backend cannot serve {kind}: {refusal}; its fixed-shape "
                f"forward runs the llama family ({', '.join(STATIC_MODEL_TYPES)})",
                "serve it with --backend cpu or --backend cuda",
            )
        reason = f"the llama family's fixed-shape forward runs {kind}"
    _refuse(
        config,
        tuple(PAGED_ONLY),
        "{given}: {what} runs in the paged engine of the cpu and cuda backends; "
        + f"{config.backend} runs a static batch",
        ", or serve with --backend cpu/cuda",
    )
    return BackendChoice(config.backend, "static", reason)


def _setting(config: ServeConfig, name: str) -> Any:
    """The value of setting `name` when it asks for something (None when it is off)."""
    value = getattr(config, name)
    if name == "lora_adapters":
        return ",".join(f"{n}={p}" for n, p in value) or None
    if name == "num_shard":
        return value if value > 1 else None
    return value if value not in (None, False, 0) else None


def _refuse(config: ServeConfig, names: tuple[str, ...], message: str, fix: str = "") -> None:
    """A ConfigError for the first setting of `names` that is on; `message` names it where
    it says {given} (as the user gave it) and {what} (what it asks for)."""
    for name in names:
        value = _setting(config, name)
        if value is None:
            continue
        what = PAGED_ONLY.get(name) or {
            "compile": "compiled decode",
            "num_shard": "tensor parallelism",
        }.get(name, name)
        given = config.label(name, "true" if value is True else value)
        raise ConfigError(
            message.format(given=given, what=what), f"drop {flag(name)} ({ENV_NAMES[name]}){fix}"
        )


def compiled_decode(config: ServeConfig, choice: BackendChoice) -> bool:
    """Whether decode steps run through compiled graphs: as --compile says, else (unset) for
    the paged engine on one CPU, where its graphs are packages a later start loads
    (paged/packages.py), with warmup on and weights its graphs take (not bitsandbytes')."""
    if config.compile is not None:
        return config.compile
    return (
        config.backend == "cpu"
        and choice.design == "paged"
        and choice.shards == 1
        and config.warmup_enabled
        and config.quantize not in BITSANDBYTES_METHODS
    )


def load_backend(
    config: ServeConfig,
    model_dir: Path,
    choice: BackendChoice | None = None,
    shared_kv_bytes_per_token: int = 0,
    compile_in_background: bool = True,
) -> Backend | PagedBackend:
    """Load the backend `choice` names (by default `choose_backend`'s for the model in
    `model_dir`) with the config's limits. `shared_kv_bytes_per_token`: what a draft model's
    KV cache takes per token of the paged pool (its share of free memory).
    `compile_in_background`: the paged engine's compiled decode, where it is not in its
    store yet, is built by a process of its own while this one serves eagerly (False: at
    warmup, as `tgis warmup` does)."""
    if choice is None:
        from tgis.hub import read_model_facts

        choice = choose_backend(config, read_model_facts(model_dir))
    log.info("backend: %s", choice.describe())
    if choice.design == "paged" and choice.shards > 1:
        from tgis.backends.paged.tensor_parallel import ShardSettings, TensorParallelBackend

        return TensorParallelBackend(ShardSettings.of(config, model_dir))
    # What every cpu / cuda design is loaded with: where, and the sequences it holds.
    where = (model_dir, config.backend, config.dtype)
    slots = {"max_sequences": config.batch_slots, "max_sequence_tokens": config.max_total_tokens}
    if choice.design == "seq2seq":
        from tgis.backends.seq2seq.backend import Seq2SeqBackend

        return Seq2SeqBackend.load(*where, **slots)
    compiles = compiled_decode(config, choice)
    if config.compile_cache and config.backend == "cpu" and not compiles:
        # The config core refused the other cases; this one depends on the model.
        raise ConfigError(
            f"{config.label('compile_cache', config.compile_cache)} keeps the compiled "
            f"decode's packages, and {choice.describe()} decodes eagerly",
            "drop --compile-cache (TGIS_COMPILE_CACHE)",
        )
    compiled = {
        "kv_tokens": config.max_batch_total_tokens,
        "compile": compiles,
        "compile_cache": Path(config.compile_cache) if config.compile_cache else None,
    }
    if choice.design == "paged":
        from tgis.backends.common.kv import kv_dtype
        from tgis.backends.common.quant import Quantization
        from tgis.backends.paged.backend import PagedTorchBackend

        return PagedTorchBackend.load(
            *where,
            **slots,
            **compiled,
            max_prefill_tokens=config.max_batch_prefill_tokens,
            memory_fraction=config.cuda_memory_fraction,
            cuda_graphs=config.cuda_graphs,
            shared_kv_bytes_per_token=shared_kv_bytes_per_token,
            quantization=Quantization.of(config),
            kv_cache_dtype=kv_dtype(config.kv_cache_dtype),
            attention_backend=config.attention_backend,
            compile_in_background=compile_in_background,
        )
    if choice.design == "fallback":
        from tgis.backends.fallback.backend import TorchDynamicBackend

        return TorchDynamicBackend.load(
            *where, **slots, **compiled, kv_memory_fraction=config.cuda_memory_fraction
        )
    if config.backend == "tpu":
        from tgis.backends.static.tpu import load_tpu_backend

        return load_tpu_backend(config, model_dir)
    if config.backend == "neuron":
        from tgis.backends.static.neuron import load_neuron_backend

        return load_neuron_backend(config, model_dir)
    if config.backend == "gaudi":
        from tgis.backends.static.gaudi import load_gaudi_backend

        return load_gaudi_backend(config, model_dir)
    raise BackendUnavailableError(
        f"unknown backend {config.backend!r}",
        "serve with --backend cpu, cuda, tpu, neuron or gaudi",
    )
