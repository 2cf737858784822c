"""Wire a validated ServeConfig into a running service: backend -> engine -> HTTP app.

Used by `tgis serve`; backends/choose.py decides which backend serves the model (the engine
itself knows only the Backend protocol).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tgis.backends.common.warmup import PhaseClock
from tgis.config import ServeConfig, check_kv_budget
from tgis.engine.backend import Backend, BackendCapacity, PagedBackend
from tgis.engine.detokenize import tokenizer_facts
from tgis.engine.engine import Engine
from tgis.engine.scheduler import SchedulerLimits
from tgis.errors import ConfigError
from tgis.prefix_store import PrefixStore
from tgis.warmup import WarmupReport, run_warmup

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from tgis.adapter_store import AdapterStore
    from tgis.backends.choose import BackendChoice
    from tgis.engine.speculation import Proposer
    from tgis.server.http.info import ModelInfo
    from tgis.vision.processor import ImageProcessor

log = logging.getLogger("tgis.launch")


@dataclass
class Service:
    """Everything `tgis serve` runs: the loaded backend, the engine, the tokenizer."""

    config: ServeConfig
    model_dir: Path
    backend: Backend | PagedBackend
    engine: Engine
    tokenizer: Any
    kv_tokens: int
    warmup: WarmupReport | None = None
    # Tuned prompt prefixes (--prefix-store-path), or None.
    prefixes: PrefixStore | None = None
    # LoRA adapters (--lora-adapters, --lora-adapter-dir), or None.
    adapters: AdapterStore | None = None
    # A vision-language model's processor (prompts with images), or None.
    vision: ImageProcessor | None = None

    def stop(self) -> None:
        """Stop the engine, then the backend's other processes (tensor parallelism)."""
        self.engine.stop()
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


@dataclass
class DraftModel:
    """--draft-model, loaded ahead of the model: its weights on the device and the bytes per
    token of its KV cache (the model's pool, sized from memory, leaves them their share)."""

    model: PreTrainedModel
    kv_bytes_per_token: int


def load_draft_model(config: ServeConfig, tokenizer: Any) -> DraftModel:
    """--draft-model's weights on the serving device, after checking that its tokenizer is the
    model's (a draft token must mean the same text) and that the paged engine runs it."""
    import torch

    from tgis.backends.common.device import load_causal_lm
    from tgis.backends.common.kv import kv_dtype
    from tgis.backends.models.families import paged_unsupported_reason
    from tgis.backends.paged.backend import paged_kv_bytes_per_token
    from tgis.hub import read_model_facts, resolve_model_dir

    name = f"--draft-model {config.draft_model}"
    draft_dir = resolve_model_dir(str(config.draft_model))
    draft_tokenizer = load_tokenizer(draft_dir, name)
    mismatch = vocabulary_mismatch(tokenizer.get_vocab(), draft_tokenizer.get_vocab())
    if mismatch is not None:
        raise ConfigError(
            f"{name}: its tokenizer is not the model's ({mismatch})",
            "draft with a smaller model of the same family, trained with the same tokenizer",
        )
    reason = paged_unsupported_reason(read_model_facts(draft_dir).config)
    if reason is not None:
        raise ConfigError(
            f"{name}: a draft model runs on the paged engine, which cannot run it: {reason}",
            "draft with a model of a family docs/models.md lists for the paged engine",
        )
    model = load_causal_lm(draft_dir, torch.device(config.backend), config.dtype)
    return DraftModel(model, paged_kv_bytes_per_token(model, kv_dtype(config.kv_cache_dtype)))


def vocabulary_mismatch(model: dict[str, int], draft: dict[str, int]) -> str | None:
    """How two tokenizers' vocabularies (token -> id) differ, or None where they are one."""
    if model == draft:
        return None
    for token, token_id in sorted(model.items(), key=lambda item: item[1]):
        if draft.get(token) != token_id:
            there = draft.get(token)
            where = "absent" if there is None else f"id {there}"
            return (
                f"{len(model)} tokens and {len(draft)}; {token!r} is id {token_id} in the "
                f"model's and {where} in the draft's"
            )
    return f"{len(model)} tokens and {len(draft)}; the draft's has tokens the model's lacks"


def draft_proposer(
    config: ServeConfig, backend: Backend | PagedBackend, draft: DraftModel
) -> Proposer:
    """The proposer drafting from --draft-model: its own paged backend, its cache as many
    tokens as the model's, decoding eagerly."""
    from tgis.backends.common.kv import kv_dtype
    from tgis.backends.paged.backend import PagedTorchBackend
    from tgis.engine.draft import DraftModelProposer

    capacity = backend.capacity
    draft_backend = PagedTorchBackend(
        draft.model,
        max_sequences=capacity.max_sequences,
        max_sequence_tokens=capacity.max_sequence_tokens,
        max_prefill_tokens=config.max_batch_prefill_tokens,
        kv_tokens=capacity.kv_tokens,
        cuda_graphs=False,
        packed_weights=None,
        kv_cache_dtype=kv_dtype(config.kv_cache_dtype),
    )
    log.info("drafting with %s (%d-token cache)", config.draft_model, capacity.kv_tokens)
    # Catch-ups in chunks of the draft's prefill step (cpu), else of --max-batch-prefill-tokens.
    step = draft_backend.capacity.prefill_step_tokens or config.max_batch_prefill_tokens
    return DraftModelProposer(
        draft_backend, vocab_size=getattr(backend, "vocab_size", None), max_step_tokens=step
    )


def eos_token_ids(model_dir: Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list), else config.json, else the tokenizer."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.extend([value] if isinstance(value, int) else (value or []))
            if ids:
                break
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def scheduler_limits(
    config: ServeConfig, capacity: BackendCapacity, kv_tokens: int
) -> SchedulerLimits:
    """The scheduler's budgets: the config's, the loaded backend's slots and KV budget, and
    the admission policy in force on its engine (ServeConfig.admission)."""
    ratio, steps = config.admission(paged=capacity.block_size is not None)
    return SchedulerLimits(
        max_batch_prefill_tokens=config.max_batch_prefill_tokens,
        max_batch_total_tokens=kv_tokens,
        max_sequences=capacity.max_sequences,
        max_batch_size=config.max_batch_size,
        waiting_served_ratio=ratio,
        max_waiting_tokens=steps,
        prefill_step_tokens=capacity.prefill_step_tokens,
        whole_images=capacity.whole_images,
        prompt_logit_tokens=capacity.prompt_logit_tokens,
        queue_threshold_ms=config.gaudi.queue_threshold_ms if config.gaudi else None,
    )


def load_tokenizer(model_dir: Path, what: str = "the model") -> Any:
    """The tokenizer in `model_dir`; a ConfigError naming `what` when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load the tokenizer of {what} ({model_dir}): {exc}",
            f"{what} needs tokenizer files",
        ) from exc


def build_service(
    config: ServeConfig,
    model_dir: Path,
    observer: Any = None,
    start_engine: bool = True,
    choice: BackendChoice | None = None,
) -> Service:
    """Load tokenizer and the backend `choice` names (by default the chooser's), run warmup
    (unless WARMUP_ENABLED=false), build the engine
    and, with `start_engine`, start its loop on a thread of its own. `tgis serve` runs the
    loop on this (its main) thread instead: `service.engine.run()`."""
    from tgis.backends.choose import choose_backend, load_backend
    from tgis.hub import read_model_facts

    if choice is None:
        choice = choose_backend(config, read_model_facts(model_dir))
    phases = StartupTimes()
    tokenizer = load_tokenizer(model_dir)
    phases.done("tokenizer")
    draft = load_draft_model(config, tokenizer) if config.draft_model else None
    backend = load_backend(config, model_dir, choice, draft.kv_bytes_per_token if draft else 0)
    phases.done("load", {"profile": getattr(backend, "profile_s", 0.0)})
    try:
        return _serve_over(config, model_dir, backend, tokenizer, draft, phases, observer,
                           start_engine)  # fmt: skip
    except BaseException:  # its other processes (shards, a compile build) end with it
        close = getattr(backend, "close", None)
        if close is not None:
            close()
        raise


def _serve_over(
    config: ServeConfig,
    model_dir: Path,
    backend: Backend | PagedBackend,
    tokenizer: Any,
    draft: DraftModel | None,
    phases: StartupTimes,
    observer: Any,
    start_engine: bool,
) -> Service:
    """`build_service` once the backend is loaded: warmup, the engine and its stores."""
    capacity = backend.capacity
    kv_tokens = check_kv_budget(config, capacity.kv_tokens)
    report = None
    if config.warmup_enabled:
        report = run_warmup(backend, config)
        log.info("%s", report.summary())
        phases.done("warmup", getattr(backend, "warmup_phases", {}))
    # What requests read of the tokenizer, read once (a walk over its vocabulary).
    tokenizer_facts(tokenizer)
    phases.done("tokenizer facts")
    engine = Engine(
        backend,
        tokenizer,
        scheduler_limits(config, capacity, kv_tokens),
        config.max_concurrent_requests,
        eos_token_ids(model_dir, tokenizer),
        observer,
        prefix_caching=config.prefix_caching is not False,
        on_fatal=exit_soon,
        speculate=config.speculate,
        proposer=draft_proposer(config, backend, draft) if draft else None,
        async_scheduling=config.async_scheduling,
    )
    prepare_grammars(engine)
    if (run_on := getattr(backend, "run_model_work_on", None)) is not None:
        run_on(engine.call)  # the backend's later model work, between the engine's steps
    adapters = adapter_store(config, model_dir, backend, engine)
    prefixes = prefix_store(config, model_dir, backend, engine)
    phases.done("engine")
    if start_engine:
        engine.start()
    log.info(
        "engine ready: %d sequences x %d tokens, KV budget %d tokens",
        capacity.max_sequences,
        capacity.max_sequence_tokens,
        kv_tokens,
    )
    log.info("runtime: %s", ", ".join(f"{k}: {v}" for k, v in backend_runtime(backend).items()))
    grammars = engine.grammars
    grammar = (
        f"{'failed' if grammars.error else 'built'} in {grammars.build_s:.2f} s"
        if grammars.build_s is not None
        else "building in a thread of its own"
    )
    log.info("start-up: %s; grammar tokenizer %s", phases, grammar)
    vision = image_processor(model_dir) if capacity.images else None
    return Service(
        config, model_dir, backend, engine, tokenizer, kv_tokens, report, prefixes, adapters,
        vision,
    )  # fmt: skip


def image_processor(model_dir: Path) -> ImageProcessor:
    """The processor of the vision-language model in `model_dir`."""
    from transformers import AutoConfig

    from tgis.vision.families import vision_family_of
    from tgis.vision.processor import ImageProcessor

    config = AutoConfig.from_pretrained(model_dir)
    family = vision_family_of(config.to_dict())
    assert family is not None
    return ImageProcessor.load(model_dir, family, config)


class StartupTimes:
    """Where start-up's time went: seconds per phase, and of its parts where the phase
    knows them (the backend's profiling forward within load; warmup's attention race,
    compile, plan and graphs), for its log line."""

    def __init__(self) -> None:
        self.clock = PhaseClock()
        self.parts: dict[str, dict[str, float]] = {}

    def done(self, phase: str, parts: dict[str, float] | None = None) -> None:
        """`phase` ended now (it began when the one before it ended); `parts`: seconds of
        what it did, within its own."""
        self.clock.done(phase)
        if parts := {k: v for k, v in (parts or {}).items() if v > 0}:
            self.parts[phase] = dict(parts)

    def __str__(self) -> str:
        def line(phase: str, seconds: float) -> str:
            parts = self.parts.get(phase)
            inner = ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()) if parts else ""
            return f"{phase} {seconds:.2f} s" + (f" ({inner})" if inner else "")

        return ", ".join(line(phase, seconds) for phase, seconds in self.clock.seconds.items())


def prepare_grammars(engine: Engine) -> None:
    """Start building structured output's form of the tokenizer (a thread of its own) rather
    than leave it to the first request with a grammar; such a request arriving before the
    build ends waits for it. The build logs its time when it ends; a tokenizer llguidance
    cannot take leaves grammars to fail per request (a 422 naming the reason) and the server
    serves the rest."""
    engine.grammars.prepare()


def exit_soon(delay_s: float = 1.0) -> None:
    """The engine died: answers already posted get `delay_s` to go out, then the process
    exits non-zero, so a supervisor restarts it rather than a server that cannot generate
    answering forever."""
    import os
    import threading

    log.critical("the engine stopped: the server exits in %.1f s", delay_s)
    threading.Timer(delay_s, os._exit, (1,)).start()


def backend_runtime(backend: Backend | PagedBackend) -> dict[str, Any]:
    """How `backend` runs, for the start-up log and /info: the engine kind, its KV budget
    (and pool), its dtype, and what the backend's `runtime()` adds where it has one."""
    capacity = backend.capacity
    facts: dict[str, Any] = {
        "engine": "paged" if capacity.block_size else "slot",
        "kv_tokens": capacity.kv_tokens,
    }
    if capacity.block_size:
        facts["kv_block_size"] = capacity.block_size
        facts["kv_blocks"] = capacity.num_blocks
    dtype = getattr(backend, "dtype", None)
    if dtype is not None:
        facts["dtype"] = str(dtype).removeprefix("torch.")
    describe = getattr(backend, "runtime", None)
    if describe is not None:
        facts.update(describe())
    return facts


def service_info(service: Service) -> ModelInfo:
    """`/info` of a loaded service: the backend's dtype, the KV budget it holds, the model's
    kind (an encoder-decoder model is a text2text-generation one), and how it runs, kept
    current where the backend says it changed (its compiled decode built meanwhile)."""
    from tgis.server.http.info import ModelInfo

    capacity = service.backend.capacity
    dtype = getattr(service.backend, "dtype", None)
    runtime = backend_runtime(service.backend)
    watch = getattr(service.backend, "watch_runtime", None)
    if watch is not None:
        lock = threading.Lock()

        def refresh(_: object = None) -> None:
            # Read and written under one lock: whichever runs last writes the latest state.
            with lock:
                runtime.update(service.backend.runtime())  # type: ignore[union-attr]

        watch(refresh)
        refresh()  # a change before the watch was set
    return ModelInfo.from_config(
        service.config,
        model_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
        max_batch_total_tokens=service.kv_tokens,
        limits=service.engine.scheduler.limits,
        encoder_decoder=capacity.encoder_decoder,
        model_pipeline_tag="text2text-generation"
        if capacity.encoder_decoder
        else "text-generation",
        runtime=runtime,
        images=capacity.images,
    )


def prefix_store(
    config: ServeConfig, model_dir: Path, backend: Backend | PagedBackend, engine: Engine
) -> PrefixStore | None:
    """The prompt-prefix store of --prefix-store-path, in the backend's dtype and device."""
    if config.prefix_store_path is None:
        return None
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(model_dir).get_text_config().hidden_size
    return PrefixStore(
        Path(config.prefix_store_path),
        hidden_size=hidden,
        # Room for one input token and one new token besides the virtual ones.
        max_length=config.max_total_tokens - 2,
        dtype=backend.dtype,  # type: ignore[union-attr]
        device=backend.device_obj,  # type: ignore[union-attr]
        encoder_decoder=backend.capacity.encoder_decoder,
        model_thread=engine.call,
    )


def adapter_store(
    config: ServeConfig, model_dir: Path, backend: Backend | PagedBackend, engine: Engine
) -> AdapterStore | None:
    """The LoRA adapters of --lora-adapters (each loaded and checked now) and
    --lora-adapter-dir, on the backend's device in its dtype; None without either."""
    if not config.lora_adapters and config.lora_adapter_dir is None:
        return None
    from transformers import AutoConfig

    from tgis.adapter_store import AdapterStore, LoraShapes, VisionNames
    from tgis.errors import InputValidationError
    from tgis.hub import resolve_model_dir

    named = {name: resolve_model_dir(path) for name, path in config.lora_adapters}
    model_config = AutoConfig.from_pretrained(model_dir)
    # A vision-language model's adapters adapt its language model (tgis.adapter_store).
    encoder = getattr(backend, "vision", None)
    vision = None
    if encoder is not None:
        vision = VisionNames(
            model_config.model_type, encoder.family.language_model, encoder.parts()
        )
    store = AdapterStore(
        LoraShapes.of(model_config.get_text_config()),
        named=named,
        directory=Path(config.lora_adapter_dir) if config.lora_adapter_dir else None,
        dtype=backend.dtype,  # type: ignore[union-attr]
        device=backend.device_obj,  # type: ignore[union-attr]
        max_loras=config.max_loras,
        max_rank=config.max_lora_rank,
        model_thread=engine.call,
        vision=vision,
    )
    for name, path in config.lora_adapters:
        try:
            store.get(name)
        except InputValidationError as exc:
            reason = exc.message.split(": ", 1)[-1]
            raise ConfigError(
                f"--lora-adapters {name}={path}: {reason}",
                "fix or drop that adapter (LORA_ADAPTERS)",
            ) from None
    log.info("LoRA adapters: %s", ", ".join(store.names()) or "none yet (on demand)")
    return store
