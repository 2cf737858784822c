"""The validation core: launcher flags + environment variables -> one frozen ServeConfig.

Every stage (serve, warmup, export-neuron) builds its limits here, so one rule set holds
everywhere. Flags win over environment variables; environment variables use the names of
TGI's launcher (MODEL_ID, MAX_TOTAL_TOKENS, ...) and of the accelerator images (HF_BATCH_SIZE,
HF_SEQUENCE_LENGTH, BATCH_BUCKET_SIZE, ...). Each violation raises ConfigError naming the
offending values, where each came from, and the fix.

This is the only module that reads environment variables (through the `env` mapping passed
in, so tests never touch os.environ).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tgis.config_gaudi import GaudiSettings, gaudi_settings
from tgis.errors import ConfigError

BACKENDS = ("auto", "cpu", "cuda", "tpu", "neuron", "gaudi")
STATIC_BACKENDS = ("tpu", "neuron")
# How a static batch prefills (see tgis.backends.buckets): recompute every slot, or only new ones.
PREFILL_MODES = ("rebuild", "insert")
DTYPES = ("float32", "float16", "bfloat16")
# TGI caps the default context at 4096 tokens to leave room for more concurrent users.
DEFAULT_MAX_TOTAL_CAP = 4096
# TGI's slack on the default prefill budget, for block-size alignment.
PREFILL_EDGE = 50
# The bundled model `tgis serve` runs when no --model-id / MODEL_ID is given.
DEMO_MODEL = str(Path(__file__).resolve().parent / "assets" / "demo-model")

_DTYPE_ALIASES = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


@dataclass(frozen=True)
class LauncherArgs:
    """Raw launcher flags as given on the command line; None means "not given"."""

    model_id: str | None = None
    revision: str | None = None
    max_concurrent_requests: int | None = None
    max_best_of: int | None = None
    max_stop_sequences: int | None = None
    max_top_n_tokens: int | None = None
    max_input_tokens: int | None = None
    max_input_length: int | None = None
    max_total_tokens: int | None = None
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_batch_size: int | None = None
    max_waiting_tokens: int | None = None
    waiting_served_ratio: float | None = None
    dtype: str | None = None
    backend: str | None = None
    num_shard: int | None = None
    sharded: bool | None = None
    port: int | None = None
    hostname: str | None = None
    api_key: str | None = None
    cors_allow_origin: str | None = None
    prefill_mode: str | None = None
    compile_cache: str | None = None
    compile: bool | None = None
    cuda_graphs: bool | None = None


# Environment fallback of each flag (TGI launcher names), and its default when neither is set.
ENV_NAMES: dict[str, str] = {f.name: f.name.upper() for f in fields(LauncherArgs)}
ENV_NAMES["backend"] = "TGIS_BACKEND"
ENV_NAMES["prefill_mode"] = "TGIS_PREFILL_MODE"
ENV_NAMES["compile_cache"] = "TGIS_COMPILE_CACHE"
ENV_NAMES["compile"] = "TGIS_COMPILE"
ENV_NAMES["cuda_graphs"] = "TGIS_CUDA_GRAPHS"
DEFAULTS: dict[str, Any] = {
    "max_concurrent_requests": 128,
    "max_best_of": 2,
    "max_stop_sequences": 4,
    "max_top_n_tokens": 5,
    "max_waiting_tokens": 20,
    "waiting_served_ratio": 0.3,
    "backend": "auto",
    "port": 3000,
    "hostname": "0.0.0.0",
}


@dataclass(frozen=True)
class ModelFacts:
    """What the validation core needs to know of a model, read from its config.json."""

    model_type: str | None = None
    max_position_embeddings: int | None = None
    neuron: NeuronExport | None = None

    @staticmethod
    def from_config(
        config: Mapping[str, Any], neuron_config: Mapping[str, Any] | None = None
    ) -> ModelFacts:
        """Facts from a config.json dict (and optimum-neuron's neuron_config.json, if any)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
        max_pos = None
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = config.get(key, text.get(key) if text else None)
            if isinstance(value, int) and value > 0:
                max_pos = value
                break
        neuron = None
        if isinstance(config.get("neuron"), Mapping):
            neuron = NeuronExport.from_mapping(config["neuron"], "config.json `neuron`")
        elif neuron_config is not None:
            neuron = NeuronExport.from_mapping(neuron_config, "neuron_config.json")
        return ModelFacts(config.get("model_type"), max_pos, neuron)


@dataclass(frozen=True)
class NeuronExport:
    """The static shape a Neuron model was compiled for."""

    batch_size: int
    sequence_length: int
    num_cores: int | None = None
    auto_cast_type: str | None = None
    source: str = "config.neuron"

    @staticmethod
    def from_mapping(data: Mapping[str, Any], source: str) -> NeuronExport:
        batch = data.get("batch_size", data.get("max_batch_size"))
        seq = data.get("sequence_length", data.get("max_context_length"))
        if not isinstance(batch, int) or not isinstance(seq, int):
            raise ConfigError(
                f"{source} lacks integer `batch_size` and `sequence_length`",
                "re-export the model with `tgis export-neuron`",
            )
        cores = data.get("num_cores", data.get("tp_degree"))
        cast = data.get("auto_cast_type", data.get("torch_dtype"))
        cast = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(cast, cast)
        return NeuronExport(batch, seq, cores if isinstance(cores, int) else None, cast, source)


@dataclass(frozen=True)
class StaticShape:
    """The one static batch of a tpu or neuron backend: [batch_size, sequence_length]."""

    batch_size: int
    sequence_length: int
    num_cores: int | None
    auto_cast_type: str | None
    source: str

    @property
    def max_tokens(self) -> int:
        return self.batch_size * self.sequence_length


@dataclass(frozen=True)
class ServeConfig:
    """Everything `tgis serve` (and warmup) needs, validated. Immutable."""

    model_id: str
    revision: str | None
    backend: str
    dtype: str | None
    num_shard: int
    port: int
    hostname: str
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    # None on dynamic backends: the KV budget is measured at warmup from free memory.
    max_batch_total_tokens: int | None
    max_batch_size: int | None
    max_waiting_tokens: int
    waiting_served_ratio: float
    warmup_enabled: bool = True
    queue_threshold_ms: int = 120
    static_shape: StaticShape | None = None
    gaudi: GaudiSettings | None = None
    # Bearer token required on generation routes; never printed.
    api_key: str | None = field(default=None, repr=False)
    cors_allow_origins: tuple[str, ...] = ()
    # Static batch prefill mode (tpu, neuron); None: the backend's best (insert where it can).
    prefill_mode: str | None = None
    # Directory where compiled device programs persist (tpu: XLA's cache; cpu/cuda with
    # compile: torch inductor's; neuron: the start-up export); None: the runtime's default.
    compile_cache: str | None = None
    # cpu/cuda: decode steps through torch.compile (compiled at warmup).
    compile: bool = False
    # cuda: decode replayed from CUDA graphs per batch bucket (recorded at warmup).
    cuda_graphs: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)

    def summary(self) -> dict[str, Any]:
        """A flat, JSON-friendly view for logs and `/info`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "notes":
                continue
            if f.name == "api_key":
                value = "set" if value else None
            if f.name in ("static_shape", "gaudi") and value is not None:
                value = {k.name: getattr(value, k.name) for k in fields(value)}
            out[f.name] = value
        return out


def default_env() -> Mapping[str, str]:
    """The process environment; callers pass it explicitly so the core stays testable."""
    return os.environ


def prepare_process_env(env: MutableMapping[str, str] | None = None) -> None:
    """Process settings that must precede `import torch` (serve calls it first thing).

    OpenMP threads that spin after each parallel region steal the cores the event loop needs to
    stream tokens between steps; passive waiting measured ~10% more tokens/s under load on 2
    cores. An explicit OMP_WAIT_POLICY in the environment wins.
    """
    (os.environ if env is None else env).setdefault("OMP_WAIT_POLICY", "PASSIVE")


def debug_enabled(env: Mapping[str, str] | None = None) -> bool:
    """TGIS_DEBUG=1 makes the CLI show tracebacks."""
    return parse_bool("TGIS_DEBUG", (env or os.environ).get("TGIS_DEBUG", "0"))


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean", f"set {name} to true or false")


def parse_int(name: str, raw: str, minimum: int | None = 1) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not an integer", f"set {name} to a whole number"
        ) from None
    if minimum is not None and value < minimum:
        raise ConfigError(
            f"{name}={value} must be >= {minimum}", f"set {name} to {minimum} or more"
        )
    return value


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number", f"set {name} to a number") from None


class _Resolver:
    """Flag > environment variable > default, remembering where each value came from."""

    def __init__(self, args: LauncherArgs, env: Mapping[str, str]) -> None:
        self.args, self.env = args, env
        self.origin: dict[str, str] = {}

    def get(self, name: str) -> Any:
        value = getattr(self.args, name)
        if value is not None:
            self.origin[name] = "flag"
            return value
        env_name = ENV_NAMES[name]
        raw = self.env.get(env_name)
        if raw is not None and raw.strip() != "":
            self.origin[name] = "env"
            kind = LauncherArgs.__dataclass_fields__[name].type
            if "bool" in str(kind):
                return parse_bool(env_name, raw)
            if "int" in str(kind):
                return parse_int(env_name, raw, minimum=None)
            if "float" in str(kind):
                return _parse_float(env_name, raw)
            return raw.strip()
        return None

    def given(self, name: str) -> bool:
        return name in self.origin

    def label(self, name: str, value: Any) -> str:
        """How to name a value in a message: `--flag 12`, `ENV=12`, or `--flag (derived: 12)`."""
        if self.origin.get(name) == "env":
            return f"{ENV_NAMES[name]}={value}"
        return (
            f"{flag(name)} {value}" if name in self.origin else f"{flag(name)} (derived: {value})"
        )


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def normalize_dtype(raw: str | None, source: str = "--dtype") -> str | None:
    if raw is None:
        return None
    dtype = _DTYPE_ALIASES.get(raw.strip().lower())
    if dtype is None:
        raise ConfigError(
            f"{source} {raw!r} is not a supported dtype",
            f"use one of {', '.join(DTYPES)}",
        )
    return dtype


def model_reference(args: LauncherArgs, env: Mapping[str, str]) -> tuple[str, str | None]:
    """(model id, revision) from --model-id/MODEL_ID and --revision/REVISION; the demo model by default."""
    model_id = args.model_id or env.get("MODEL_ID", "").strip() or DEMO_MODEL
    revision = args.revision or env.get("REVISION", "").strip() or None
    return model_id, revision


def build_serve_config(
    args: LauncherArgs,
    facts: ModelFacts,
    env: Mapping[str, str] | None = None,
    detect_backend: Callable[[ModelFacts], str] | None = None,
) -> ServeConfig:
    """Resolve flags, environment and model facts into a validated ServeConfig.

    `detect_backend` resolves `--backend auto` (see tgis.backends.registry); without it,
    auto means neuron for a Neuron-exported model and cpu otherwise.
    """
    env = default_env() if env is None else env
    r = _Resolver(args, env)
    values = {f.name: r.get(f.name) for f in fields(LauncherArgs)}
    notes: list[str] = []

    backend = (values["backend"] or "auto").lower()
    if backend not in BACKENDS:
        raise ConfigError(
            f"--backend {backend!r} is not a backend", f"use one of {', '.join(BACKENDS)}"
        )
    if backend == "auto":
        backend = detect_backend(facts) if detect_backend else ("neuron" if facts.neuron else "cpu")
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
    _check_value_ranges(values, r)

    static = None
    if backend in STATIC_BACKENDS:
        from tgis.config_static import apply_static_rules

        static, dtype = apply_static_rules(backend, values, r, facts, env, dtype, notes)
    else:
        _derive_dynamic_defaults(values, r, facts, notes)

    _check_general_rules(values, r, facts)
    gaudi = gaudi_settings(env, values, notes) if backend == "gaudi" else None

    num_shard = values["num_shard"] or 1
    if values["sharded"] is False and num_shard > 1:
        raise ConfigError(
            f"--sharded false contradicts {r.label('num_shard', num_shard)}",
            "drop --sharded false, or set --num-shard 1",
        )
    if backend == "cpu" and (num_shard > 1 or values["sharded"]):
        raise ConfigError(
            f"the cpu backend runs one shard, not {r.label('num_shard', num_shard) if num_shard > 1 else '--sharded true'}",
            "drop --num-shard / --sharded, or pick a multi-device backend such as --backend cuda",
        )
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
    if values["compile_cache"] and not (
        backend in ("tpu", "neuron") or (values["compile"] and not values["cuda_graphs"])
    ):
        raise ConfigError(
            f"{r.label('compile_cache', values['compile_cache'])} has nothing to keep on "
            f"{backend}{' with --cuda-graphs' if values['cuda_graphs'] else ''}: it holds XLA "
            "programs (tpu), the start-up export (neuron) or torch.compile's caches (--compile)",
            "drop --compile-cache (TGIS_COMPILE_CACHE), or add --compile on cpu/cuda",
        )
    warmup = parse_bool("WARMUP_ENABLED", env.get("WARMUP_ENABLED", "true"))
    queue_ms = parse_int("QUEUE_THRESHOLD_MS", env.get("QUEUE_THRESHOLD_MS", "120"), minimum=0)

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
        warmup_enabled=warmup,
        queue_threshold_ms=queue_ms,
        static_shape=static,
        gaudi=gaudi,
        api_key=values["api_key"] or None,
        cors_allow_origins=tuple(
            o.strip() for o in (values["cors_allow_origin"] or "").split(",") if o.strip()
        ),
        prefill_mode=prefill_mode,
        compile_cache=values["compile_cache"] or None,
        compile=bool(values["compile"]),
        cuda_graphs=bool(values["cuda_graphs"]),
        notes=tuple(notes),
    )


def _derive_dynamic_defaults(
    values: dict[str, Any], r: _Resolver, facts: ModelFacts, notes: list[str]
) -> None:
    """TGI's launcher defaults for dynamic-shape backends (cpu, cuda, gaudi)."""
    max_pos = facts.max_position_embeddings
    if values["max_total_tokens"] is None:
        default = DEFAULT_MAX_TOTAL_CAP if max_pos is None else min(max_pos, DEFAULT_MAX_TOTAL_CAP)
        if values["max_input_tokens"] is not None:
            # Room for at least one new token, within what the model can address.
            wanted = max(default, values["max_input_tokens"] + 1)
            default = wanted if max_pos is None else min(wanted, max_pos)
        elif max_pos is not None and max_pos > DEFAULT_MAX_TOTAL_CAP:
            notes.append(
                f"the model supports {max_pos} positions; the default context is "
                f"{DEFAULT_MAX_TOTAL_CAP} to leave memory for more users "
                f"(raise it with --max-total-tokens {max_pos} --max-input-tokens {max_pos - 1} "
                f"--max-batch-prefill-tokens {max_pos + PREFILL_EDGE})"
            )
        values["max_total_tokens"] = default
    if values["max_input_tokens"] is None:
        values["max_input_tokens"] = values["max_total_tokens"] - 1
    if values["max_batch_prefill_tokens"] is None:
        if values["max_batch_size"] is not None:
            values["max_batch_prefill_tokens"] = (
                values["max_batch_size"] * values["max_input_tokens"]
            )
        else:
            values["max_batch_prefill_tokens"] = values["max_input_tokens"] + PREFILL_EDGE


def _check_general_rules(values: dict[str, Any], r: _Resolver, facts: ModelFacts) -> None:
    """The rules every backend shares (TGI launcher semantics)."""
    mi, mt = values["max_input_tokens"], values["max_total_tokens"]
    prefill, total = values["max_batch_prefill_tokens"], values["max_batch_total_tokens"]
    if mi >= mt:
        raise ConfigError(
            f"{r.label('max_input_tokens', mi)} must be < {r.label('max_total_tokens', mt)}",
            f"lower --max-input-tokens to at most {mt - 1}, or raise --max-total-tokens above {mi}",
        )
    max_pos = facts.max_position_embeddings
    if max_pos is not None and mt > max_pos:
        raise ConfigError(
            f"{r.label('max_total_tokens', mt)} exceeds the model's {max_pos} positions "
            "(max_position_embeddings in its config.json)",
            f"set --max-total-tokens {max_pos} or less",
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
        if mt > total:
            raise ConfigError(
                f"{r.label('max_total_tokens', mt)} must be <= {r.label('max_batch_total_tokens', total)}: "
                "one full-length request could never fit in the batch",
                f"raise --max-batch-total-tokens to at least {mt}",
            )


def _check_value_ranges(values: dict[str, Any], r: _Resolver) -> None:
    """Fill TGI's plain defaults and check each value on its own (counts, ratios)."""
    for name in (
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_top_n_tokens",
        "max_waiting_tokens",
        "waiting_served_ratio",
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
        "port",
    ):
        if values[name] is not None and values[name] < 1:
            raise ConfigError(
                f"{r.label(name, values[name])} must be >= 1",
                f"set {flag(name)} to a positive value",
            )
    for name in ("max_stop_sequences", "max_top_n_tokens", "max_waiting_tokens"):
        if values[name] < 0:
            raise ConfigError(
                f"{r.label(name, values[name])} must be >= 0", f"set {flag(name)} to 0 or more"
            )
    if values["waiting_served_ratio"] <= 0:
        raise ConfigError(
            f"{r.label('waiting_served_ratio', values['waiting_served_ratio'])} must be > 0",
            "use a ratio such as 0.3 (TGI's default) or 1.2",
        )
