"""The validation core's types: the raw launcher flags in, the validated configuration out.

Plain frozen dataclasses with no rules of their own (the rules are in tgis.config.rules,
.static and .gaudi; tgis.config.resolve builds a ServeConfig from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tgis.config.parse import flag

# TGI's admission policy defaults (ServeConfig.admission).
TGI_WAITING_SERVED_RATIO = 0.3
TGI_MAX_WAITING_TOKENS = 20
BACKENDS = ("auto", "cpu", "cuda", "tpu", "neuron", "gaudi")
# Backends whose whole batch has one static shape fixed before serving (tgis.config.static).
STATIC_BACKENDS = ("tpu", "neuron")
# `--quantize`: methods that quantize a float checkpoint's weights at load (the paged engine,
# cpu and cuda; fp8 on CUDA only; the bitsandbytes ones through that package), and int4's
# group sizes (`--quantize-group-size`).
BITSANDBYTES_METHODS = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")
QUANTIZE_METHODS = ("int8", "int4", "fp8", *BITSANDBYTES_METHODS)
QUANTIZE_GROUP_SIZES = (32, 64, 128)
DEFAULT_QUANTIZE_GROUP_SIZE = 64
# `--kv-cache-dtype`: the paged engine's KV pool in the model's dtype ("auto") or in float8,
# each key and value rounded on write (TGI's names; vLLM's `fp8` and `fp8_e4m3` name e4m3fn).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3fn", "fp8_e5m2")
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3fn", "fp8_e4m3": "fp8_e4m3fn"}
# How a static batch prefills (see tgis.backends.static.buckets): recompute every slot, or only new ones.
# The most draft tokens speculative decoding verifies per step (--speculate).
MAX_SPECULATE = 16
PREFILL_MODES = ("rebuild", "insert")
# What a LoRA adapter's name may hold (--lora-adapters, adapter_id, a --lora-adapter-dir entry).
ADAPTER_NAME = r"[/\w\-.]+"


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
    playground: bool | None = None
    allow_image_urls: bool | None = None
    max_images_per_request: int | None = None
    max_image_pixels: int | None = None
    max_image_bytes: int | None = None
    prefill_mode: str | None = None
    model_impl: str | None = None
    attention_backend: str | None = None
    quantize: str | None = None
    quantize_group_size: int | None = None
    kv_cache_dtype: str | None = None
    compile_cache: str | None = None
    compile: bool | None = None
    cuda_graphs: bool | None = None
    async_scheduling: bool | None = None
    prefix_caching: bool | None = None
    cuda_memory_fraction: float | None = None
    speculate: int | None = None
    draft_model: str | None = None
    rerank_tokens: str | None = None
    rerank_template: str | None = None
    lora_adapters: str | None = None
    lora_adapter_dir: str | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    prefix_store_path: str | None = None
    max_request_body_bytes: int | None = None
    max_stored_responses: int | None = None
    header_timeout_s: float | None = None
    body_timeout_s: float | None = None
    keep_alive_timeout_s: float | None = None
    # Tensor parallelism's rendezvous (torch.distributed), as TGI and TGIS name it.
    master_addr: str | None = None
    master_port: int | None = None
    # Multi-node tensor parallelism (torchrun's names): the hosts the shards span, this host's
    # place among them, the network interface the shards talk over, and how long start-up
    # waits for every node and a running server for a silent one.
    nnodes: int | None = None
    node_rank: int | None = None
    socket_ifname: str | None = None
    join_timeout_s: float | None = None
    node_timeout_s: float | None = None
    # TGIS's names for the same settings (tgis.config.env.ALIASES).
    model_name: str | None = None
    max_sequence_length: int | None = None
    dtype_str: str | None = None
    # The TGIS gRPC API and TLS (tgis.fmaas).
    max_new_tokens: int | None = None
    grpc: bool | None = None
    grpc_port: int | None = None
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_client_ca_cert_path: str | None = None
    output_special_tokens: bool | None = None
    default_include_stop_seqs: bool | None = None


@dataclass(frozen=True)
class TlsFiles:
    """Server certificate and key (PEM), and the CA that client certificates must be signed by
    (mutual TLS) when set. Checked readable at start-up."""

    cert_path: str
    key_path: str
    client_ca_cert_path: str | None = None


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


def multiples(step: int, high: int) -> tuple[int, ...]:
    """step, 2*step, ... up to `high`, then `high` itself when it is not a multiple."""
    values = list(range(step, high + 1, step))
    if not values or values[-1] < high:
        values.append(high)
    return tuple(values)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class GaudiSettings:
    """Seed 003's environment table, read and checked by tgis.config.gaudi.gaudi_settings."""

    batch_bucket_size: int = 8
    prefill_batch_bucket_size: int = 4
    pad_sequence_to_multiple_of: int = 128
    enable_hpu_graph: bool = True
    limit_hpu_graph: bool = True
    skip_tokenizer_in_tgi: bool = False
    use_flash_attention: bool = True
    flash_attention_recompute: bool = True
    quant_config: str | None = None
    # Waiting longer than this makes a request overdue: overdue requests go first (oldest
    # first), the others shortest prompt first (tgis.engine.scheduler).
    queue_threshold_ms: int = 120
    prof_waitstep: int = 0
    prof_warmupstep: int = 0
    prof_step: int = 0
    prof_path: str = "/tmp/hpu_profile"
    prof_ranks: tuple[int, ...] = (0,)
    prof_record_shapes: bool = False
    # This process's rank (RANK) and whether the HPU runs in lazy mode (PT_HPU_LAZY_MODE != 0).
    rank: int = 0
    lazy_mode: bool = True
    # Derived from the launcher limits:
    decode_batch_size: int = 0
    prefill_batch_size: int = 0
    max_input_tokens: int = 0

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """Batch sizes that decode graphs are captured for."""
        return multiples(self.batch_bucket_size, self.decode_batch_size)

    @property
    def length_buckets(self) -> tuple[int, ...]:
        """Prompt lengths prefill pads to: multiples of the pad, and the longest prompt itself."""
        return multiples(self.pad_sequence_to_multiple_of, self.max_input_tokens)

    @property
    def prefill_rows(self) -> tuple[int, ...]:
        """Prefill batch sizes: multiples of PREFILL_BATCH_BUCKET_SIZE up to the prefill batch,
        which never exceeds the decode batch (the slots the prefilled sequences join)."""
        return multiples(
            self.prefill_batch_bucket_size, min(self.prefill_batch_size, self.decode_batch_size)
        )

    @property
    def prefill_buckets(self) -> tuple[tuple[int, int], ...]:
        """(batch size, padded prompt length) pairs that prefill graphs are captured for."""
        return tuple((b, length) for b in self.prefill_rows for length in self.length_buckets)

    @property
    def profiling(self) -> bool:
        return self.prof_step > 0


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
    # TGI's admission policy (`admission`); None: not set.
    max_waiting_tokens: int | None
    waiting_served_ratio: float | None
    warmup_enabled: bool = True
    static_shape: StaticShape | None = None
    gaudi: GaudiSettings | None = None
    # Bearer token required on generation routes; never printed.
    api_key: str | None = field(default=None, repr=False)
    cors_allow_origins: tuple[str, ...] = ()
    # The browser page at GET / (tgis.server.http.playground); --no-playground turns it off.
    playground: bool = True
    # Images in requests to a vision-language model (tgis.server.http.images): whether http(s) URLs
    # are fetched (only public addresses), and the per-request limits: images, pixels per image
    # and encoded bytes per image.
    allow_image_urls: bool = False
    max_images_per_request: int = 8
    max_image_pixels: int = 4096 * 4096
    max_image_bytes: int = 20_000_000
    # Static batch prefill mode (tpu, neuron); None: the backend's best (insert where it can).
    prefill_mode: str | None = None
    # cpu/cuda decoder-only models: whose forward runs the model. "auto": the paged engine's
    # where its family has one, else transformers'; "tgis": the paged engine's (an error where
    # it has none); "transformers": transformers' forward on the slot engine.
    model_impl: str = "auto"
    # The paged engine's attention (cpu/cuda): "triton" (tgis's kernels), "flash" (torch's
    # varlen_attn over KV pages) or "torch" (plain torch over head-major blocks); None: auto,
    # the backend picks where it loads (paged/backend.py).
    attention_backend: str | None = None
    # Weight quantization of the paged engine (cpu/cuda): --quantize's method (int8, int4,
    # fp8), or the format of a pre-quantized checkpoint read from its config.json; None: the
    # weights in the serving dtype. The group size is int4's columns per scale (else None, and
    # None for a checkpoint that stores them per tensor). quantized_checkpoint: the weights are
    # read quantized from the checkpoint (tgis.config.checkpoint_quant), not quantized at load.
    quantize: str | None = None
    quantize_group_size: int | None = None
    quantized_checkpoint: bool = False
    # The paged engine's KV pool: None, the model's dtype; or one of KV_CACHE_DTYPES' float8
    # names (cpu/cuda, the plain-torch attention path).
    kv_cache_dtype: str | None = None
    # Directory where compiled device programs persist (tpu: XLA's cache; cpu: the compiled
    # decode's packages; cuda with compile: torch inductor's; neuron: the start-up export);
    # None: the runtime's default.
    compile_cache: str | None = None
    # cpu/cuda: decode steps through compiled graphs. None (what the launcher resolves when
    # --compile is not given): the chooser's default, on for the paged engine on one CPU
    # (backends/choose.py's `compiled_decode`); built here, off unless asked.
    compile: bool | None = False
    # cuda: decode replayed from CUDA graphs per batch bucket (recorded at warmup). None: not
    # set, on wherever the paged engine has flash attention; True: required; False: eager.
    cuda_graphs: bool | None = None
    # The paged engine plans and launches each step while the device runs the one before
    # (tgis.engine.step_runner.PipelinedSteps). None: not set, where the device runs apart
    # from the host and nothing speculates; True: required; False: off.
    async_scheduling: bool | None = None
    # Share KV blocks of common prompt prefixes (the paged engine). None: not set, on wherever
    # the paged engine runs; True: required (an error where it cannot run); False: off.
    prefix_caching: bool | None = None
    # cuda: the share of the GPU's memory the server may use (weights, activations, KV cache);
    # None: the backend's default.
    cuda_memory_fraction: float | None = None
    # Speculative decoding: draft tokens (n-gram prompt lookup) verified with each decode step
    # of the paged engine, at most; 0: off.
    speculate: int = 0
    # A small model of the same tokenizer (a directory or a cached Hub id) that drafts for
    # speculative decoding instead of prompt lookup; None: prompt lookup.
    draft_model: str | None = None
    # A causal LM served as a reranker by its yes/no answer (tgis.pooling.spec): the token
    # scored and the one it is weighed against (--rerank-tokens), and the Jinja file a
    # (query, document) pair is rendered into (--rerank-template); (): not a reranker.
    rerank_tokens: tuple[str, ...] = ()
    rerank_template: str | None = None
    # LoRA adapters (the paged engine): (name, directory or Hub id) pairs named at start-up,
    # the directory whose subdirectories are loaded on demand, how many stay loaded, and the
    # largest rank served.
    lora_adapters: tuple[tuple[str, str], ...] = ()
    lora_adapter_dir: str | None = None
    max_loras: int = 8
    max_lora_rank: int = 64
    # The TGIS gRPC API (fmaas.GenerationService) on its own port; None: not served.
    grpc_port: int | None = None
    # The largest max_new_tokens a request may ask for; gRPC's default ceiling is 1024 (TGIS),
    # the HTTP routes apply it only when it is set.
    max_new_tokens: int | None = None
    # gRPC defaults (TGIS): special tokens in the output text; stop sequences kept in the text.
    output_special_tokens: bool = False
    default_include_stop_seqs: bool = True
    # TLS on both the HTTP and the gRPC port; None: plain text.
    tls: TlsFiles | None = None
    # The directory of tuned prompt prefixes (PREFIX_STORE_PATH); None: no prefixes.
    prefix_store_path: str | None = None
    # The largest request body the HTTP routes read (TGI's payload limit); larger is a 413.
    max_request_body_bytes: int = 2_000_000
    # Responses the /v1/responses route keeps for `previous_response_id` (least recently used
    # first out); 0 keeps none.
    max_stored_responses: int = 1000
    # Slow clients (tgis.server.http.timeouts): seconds a request's headers may take to arrive, then
    # its body; and how long a keep-alive connection may stay idle between requests.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    # Where the shards of --num-shard > 1 meet (torch.distributed's TCP rendezvous).
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Multi-node: --num-shard's ranks over `nnodes` hosts, num_shard / nnodes on each; this
    # host is node `node_rank` (0 serves HTTP/gRPC, the others only compute). The interface
    # gloo and NCCL bind (None: theirs to pick, or GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME);
    # seconds start-up waits for every node; seconds a running node may stay silent.
    nnodes: int = 1
    node_rank: int = 0
    socket_ifname: str | None = None
    join_timeout_s: float = 600.0
    node_timeout_s: float = 30.0
    notes: tuple[str, ...] = field(default=(), compare=False)
    # Where each setting given by the user came from: field -> `--flag` or `ENV_NAME`.
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def batch_slots(self) -> int:
        """The sequences one step may hold: --max-batch-size, else --max-concurrent-requests."""
        return self.max_batch_size or self.max_concurrent_requests

    def admission(self, paged: bool) -> tuple[float, int]:
        """TGI's admission policy in force, (waiting_served_ratio, max_waiting_tokens): while
        a batch runs, new requests wait until ratio x the running ones wait, or max waiting
        tokens steps have passed. Unset values are TGI's defaults on the slot engine, whose
        prefill steps stop the batch's decoding; the paged engine, whose prefill chunks ride
        along with the decodes, admits at the next step unless either is set."""
        if paged and self.waiting_served_ratio is None and self.max_waiting_tokens is None:
            return 0.0, 0
        ratio, steps = self.waiting_served_ratio, self.max_waiting_tokens
        return (
            TGI_WAITING_SERVED_RATIO if ratio is None else ratio,
            TGI_MAX_WAITING_TOKENS if steps is None else steps,
        )

    def label(self, name: str, value: Any) -> str:
        """How a message names a setting the user gave: `--flag value` or `ENV=value` as it
        was given (the flag where it came from a default)."""
        spelled = dict(self.sources).get(name) or flag(name)
        return f"{spelled} {value}" if spelled.startswith("-") else f"{spelled}={value}"

    def summary(self) -> dict[str, Any]:
        """A flat, JSON-friendly view for logs and `/info`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("notes", "sources"):
                continue
            if f.name == "api_key":
                value = "set" if value else None
            if f.name in ("static_shape", "gaudi", "tls") and value is not None:
                value = {k.name: getattr(value, k.name) for k in fields(value)}
            out[f.name] = value
        return out
