"""The launcher flags of `serve` and `warmup` (TGI's names), defined once.

Each flag defaults to None: the validation core (tgis.config) applies the environment
fallback and the derived default, so the help shows what the default will be. A command takes
them with `@launcher_options(...)` and receives them as keyword arguments.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from tgis.config import DEFAULTS, ENV_NAMES, LauncherArgs, ModelFacts, ServeConfig

MODEL = "Model"
LIMITS = "Request limits"
BATCHING = "Batching (continuous batcher)"
DEVICE = "Backend and device"
SERVER = "Server"


def _opt(
    name: str,
    panel: str,
    help_text: str,
    default: str | None = None,
    negatable: bool = False,
    **kw: Any,
) -> Any:
    """A launcher option; `negatable` bools get a `--no-` form too (unset: the default)."""
    env = ENV_NAMES[name]
    shown = default if default is not None else str(DEFAULTS.get(name, "derived"))
    flag = "--" + name.replace("_", "-")
    return typer.Option(
        f"{flag}/--no-{flag[2:]}" if negatable else flag,
        help=f"{help_text} \\[env: {env}]",
        rich_help_panel=panel,
        show_default=shown if shown else False,
        **kw,
    )


ModelId = Annotated[
    str | None,
    _opt("model_id", MODEL, "Hub model id or local directory.", "the bundled demo model"),
]
Revision = Annotated[
    str | None, _opt("revision", MODEL, "Branch, tag or commit of the model.", "main")
]
Dtype = Annotated[
    str | None,
    _opt(
        "dtype",
        DEVICE,
        "float32, float16 or bfloat16.",
        "cpu: bfloat16 where native, else float32; cuda: the model's half dtype",
    ),
]
Backend = Annotated[str | None, _opt("backend", DEVICE, "auto, cpu, cuda, tpu, neuron or gaudi.")]
NumShard = Annotated[
    int | None,
    _opt(
        "num_shard",
        DEVICE,
        "Devices to shard the model over (tensor parallelism on cpu/cuda), or the Neuron cores.",
        "1",
    ),
]
MasterAddr = Annotated[
    str | None, _opt("master_addr", DEVICE, "Where the shards of --num-shard meet.")
]
MasterPort = Annotated[int | None, _opt("master_port", DEVICE, "The shards' rendezvous port.")]
Nnodes = Annotated[
    int | None,
    _opt(
        "nnodes",
        DEVICE,
        "Hosts the --num-shard shards span (num-shard / nnodes on each); node 0 serves, the "
        "others only compute.",
    ),
]
NodeRank = Annotated[
    int | None,
    _opt(
        "node_rank",
        DEVICE,
        "This host's node: 0 serves (at --master-addr), 1 to nnodes-1 run their shards only.",
    ),
]
SocketIfname = Annotated[
    str | None,
    _opt(
        "socket_ifname",
        DEVICE,
        "Network interface the shards talk over (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME).",
        "those variables; across nodes gloo's is the interface towards --master-addr",
    ),
]
JoinTimeoutS = Annotated[
    float | None,
    _opt("join_timeout_s", DEVICE, "Seconds start-up waits for every node to join."),
]
NodeTimeoutS = Annotated[
    float | None,
    _opt(
        "node_timeout_s",
        DEVICE,
        "Seconds a node may stay silent before the server (and every node) stops.",
    ),
]
Sharded = Annotated[
    str | None, _opt("sharded", DEVICE, "Shard the model: true or false.", "false", metavar="BOOL")
]
MaxConcurrentRequests = Annotated[
    int | None,
    _opt(
        "max_concurrent_requests",
        LIMITS,
        "Requests in flight before 429 'Model is overloaded'.",
        "128; the static batch size on tpu",
    ),
]
MaxBestOf = Annotated[
    int | None, _opt("max_best_of", LIMITS, "Largest best_of a request may ask for.")
]
MaxStopSequences = Annotated[
    int | None, _opt("max_stop_sequences", LIMITS, "Most stop sequences per request.")
]
MaxTopNTokens = Annotated[
    int | None, _opt("max_top_n_tokens", LIMITS, "Largest top_n_tokens per request.")
]
MaxInputTokens = Annotated[
    int | None,
    _opt("max_input_tokens", LIMITS, "Longest prompt, in tokens.", "max-total-tokens - 1"),
]
MaxInputLength = Annotated[
    int | None, _opt("max_input_length", LIMITS, "Alias of --max-input-tokens.", "")
]
MaxTotalTokens = Annotated[
    int | None,
    _opt(
        "max_total_tokens",
        LIMITS,
        "Prompt + new tokens per request.",
        "min(model positions, 4096); max_length on tpu/neuron",
    ),
]
MaxBatchPrefillTokens = Annotated[
    int | None,
    _opt(
        "max_batch_prefill_tokens",
        BATCHING,
        "Token budget of one prefill step.",
        "max-input-tokens + 50",
    ),
]
MaxBatchTotalTokens = Annotated[
    int | None,
    _opt(
        "max_batch_total_tokens",
        BATCHING,
        "KV budget of the running batch, in tokens.",
        "measured at warmup; batch x max_length on tpu/neuron",
    ),
]
MaxBatchSize = Annotated[
    int | None,
    _opt(
        "max_batch_size",
        BATCHING,
        "Most requests in one batch.",
        "unbounded; the static batch size on tpu/neuron",
    ),
]
MaxWaitingTokens = Annotated[
    int | None,
    _opt(
        "max_waiting_tokens",
        BATCHING,
        "Decode steps before waiting requests are forced into the batch (TGI's admission "
        "policy; the paged engine applies it only when this or --waiting-served-ratio is set).",
        "20 on the slot engine; 0 on the paged engine",
    ),
]
WaitingServedRatio = Annotated[
    float | None,
    _opt(
        "waiting_served_ratio",
        BATCHING,
        "Waiting/running ratio that lets new requests into a running batch (TGI's admission "
        "policy; the paged engine applies it only when this or --max-waiting-tokens is set).",
        "0.3 on the slot engine; 0 (admit at the next step) on the paged engine",
    ),
]
PrefillMode = Annotated[
    str | None,
    _opt(
        "prefill_mode",
        DEVICE,
        "Static batch prefill (tpu, neuron): insert (new slots only) or rebuild (every slot).",
        "insert where the device model can",
    ),
]
ModelImpl = Annotated[
    str | None,
    _opt(
        "model_impl",
        DEVICE,
        "cpu/cuda: whose forward runs a decoder-only model: auto, tgis (the paged engine's, "
        "an error for a family it has none for) or transformers (transformers' forward on "
        "the slot engine).",
        "auto: the paged engine's where the model's family has one",
    ),
]
AttentionBackend = Annotated[
    str | None,
    _opt(
        "attention_backend",
        DEVICE,
        "cpu/cuda: the paged engine's attention: auto, triton (tgis's Triton kernels over KV "
        "pages; on a CPU only under TRITON_INTERPRET=1), flash (torch's varlen_attn over KV "
        "pages, CUDA with torch >= 2.12) or torch (plain torch over head-major blocks).",
        "auto: triton on CUDA where Triton is installed (the faster of it and flash, timed at "
        "warmup, where both run), else flash where it runs, else torch",
    ),
]
Quantize = Annotated[
    str | None,
    _opt(
        "quantize",
        DEVICE,
        "cpu/cuda, paged engine: quantize the weights at load: int8 (weight-only, per "
        "channel), int4 (weight-only, group-wise), fp8 (CUDA, compute capability 8.9+), "
        "bitsandbytes (LLM.int8()), bitsandbytes-nf4 or bitsandbytes-fp4 (the bitsandbytes "
        "extra). Pre-quantized checkpoints are detected without it.",
        "none: the serving dtype",
    ),
]
QuantizeGroupSize = Annotated[
    int | None,
    _opt(
        "quantize_group_size",
        DEVICE,
        "--quantize int4: input columns sharing one scale and zero point (32, 64 or 128).",
        "64",
    ),
]
CompileCache = Annotated[
    str | None,
    _opt(
        "compile_cache",
        DEVICE,
        "Where compiled programs persist: the compiled decode's packages (cpu), XLA's cache (tpu), inductor's (--compile on cuda), the neuron export.",
        "cpu: tgis/compiled under HF_HOME",
    ),
]
Compile = Annotated[
    bool | None,
    _opt(
        "compile",
        DEVICE,
        "cpu/cuda: run decode steps through compiled graphs. On by default for the paged engine on a CPU: a first start serves eagerly while a process of its own compiles them into --compile-cache, later starts load them; --no-compile opts out.",
        "on for the paged engine on cpu",
        negatable=True,
    ),
]
CudaGraphs = Annotated[
    bool | None,
    _opt(
        "cuda_graphs",
        DEVICE,
        "cuda: replay the paged engine's decode steps from CUDA graphs, one per batch bucket "
        "(recorded during warmup); --no-cuda-graphs runs them eagerly.",
        "on where flash attention runs",
        negatable=True,
    ),
]
PrefixCaching = Annotated[
    bool | None,
    _opt(
        "prefix_caching",
        DEVICE,
        "cpu/cuda paged engine: reuse the KV blocks of prompt prefixes other requests computed.",
        "on where the paged engine runs",
        negatable=True,
    ),
]
AsyncScheduling = Annotated[
    bool | None,
    _opt(
        "async_scheduling",
        DEVICE,
        "paged engine: plan and launch each step while the device runs the one before, and "
        "hand that one's tokens over meanwhile; --no-async-scheduling plans each step after "
        "the one before is handed over.",
        "off (on only when asked: it has not yet run on a GPU); never with --speculate",
        negatable=True,
    ),
]
Speculate = Annotated[
    int | None,
    _opt(
        "speculate",
        DEVICE,
        "cpu/cuda paged engine: speculative decoding, verifying up to N draft tokens (n-gram "
        "prompt lookup: text the prompt already holds) with each decode step; 0 is off.",
        "0",
    ),
]
RerankTokens = Annotated[
    str | None,
    _opt(
        "rerank_tokens",
        MODEL,
        "Serve a causal LM as a reranker scored by its answer: YES,NO, the token whose "
        "probability against the other is the score (Qwen3-Reranker: yes,no).",
        "none: a causal LM generates",
    ),
]
RerankTemplate = Annotated[
    str | None,
    _opt(
        "rerank_template",
        MODEL,
        "With --rerank-tokens: a Jinja file that places {{ query }} and {{ document }} in the "
        "text the model judges (its model card's prompt).",
        "none: the pair as the tokenizer joins it",
    ),
]
DraftModel = Annotated[
    str | None,
    _opt(
        "draft_model",
        DEVICE,
        "With --speculate: a small model of the same tokenizer (a directory or a cached Hub "
        "id, llama family) that drafts the tokens instead of prompt lookup.",
        "none: prompt lookup",
    ),
]
CudaMemoryFraction = Annotated[
    float | None,
    _opt(
        "cuda_memory_fraction",
        DEVICE,
        "cuda: share of the GPU's memory the server may use; the KV cache gets what the "
        "weights and the largest prefill leave of it.",
        "0.85",
    ),
]
Port = Annotated[int | None, _opt("port", SERVER, "HTTP port.")]
ApiKey = Annotated[
    str | None,
    _opt("api_key", SERVER, "Bearer token required on generation routes.", "none"),
]
CorsAllowOrigin = Annotated[
    str | None,
    _opt("cors_allow_origin", SERVER, "Comma-separated origins allowed by CORS.", "none"),
]
Hostname = Annotated[str | None, _opt("hostname", SERVER, "Address to listen on.")]
ModelName = Annotated[str | None, _opt("model_name", MODEL, "TGIS's name for --model-id.", "")]
MaxSequenceLength = Annotated[
    int | None, _opt("max_sequence_length", LIMITS, "TGIS's name for --max-total-tokens.", "")
]
DtypeStr = Annotated[str | None, _opt("dtype_str", DEVICE, "TGIS's name for --dtype.", "")]
MaxNewTokens = Annotated[
    int | None,
    _opt(
        "max_new_tokens",
        LIMITS,
        "Largest max_new_tokens a request may ask for (TGIS).",
        "1024 on gRPC; HTTP: what fits in --max-total-tokens",
    ),
]
Grpc = Annotated[
    bool | None,
    _opt(
        "grpc",
        SERVER,
        "Serve TGIS's gRPC API (fmaas.GenerationService) beside HTTP; --no-grpc: HTTP only.",
        "on",
        negatable=True,
    ),
]
Playground = Annotated[
    bool | None,
    _opt(
        "playground",
        SERVER,
        "Serve the browser playground at GET / (chat, raw completion, server panel); "
        "--no-playground: GET / answers like /health only.",
        "on",
        negatable=True,
    ),
]
GrpcPort = Annotated[int | None, _opt("grpc_port", SERVER, "gRPC port.")]
TlsCertPath = Annotated[
    str | None,
    _opt("tls_cert_path", SERVER, "Server certificate (PEM): TLS on HTTP and gRPC.", "none"),
]
TlsKeyPath = Annotated[
    str | None, _opt("tls_key_path", SERVER, "Private key of --tls-cert-path (PEM).", "none")
]
TlsClientCaCertPath = Annotated[
    str | None,
    _opt(
        "tls_client_ca_cert_path",
        SERVER,
        "CA (PEM) that client certificates must be signed by: mutual TLS on both ports.",
        "none",
    ),
]
MaxRequestBodyBytes = Annotated[
    int | None,
    _opt(
        "max_request_body_bytes",
        LIMITS,
        "Largest request body the HTTP routes read; larger ones are refused with 413.",
    ),
]
MaxStoredResponses = Annotated[
    int | None,
    _opt(
        "max_stored_responses",
        LIMITS,
        "Responses of /v1/responses kept for `previous_response_id` (least recently used are "
        "dropped first; 0 keeps none).",
    ),
]
AllowImageUrls = Annotated[
    bool | None,
    _opt(
        "allow_image_urls",
        SERVER,
        "Vision-language models: fetch images given as http(s) URLs (public addresses only, "
        "every redirect checked); off: only data URLs are read.",
        "off",
    ),
]
MaxImagesPerRequest = Annotated[
    int | None,
    _opt(
        "max_images_per_request",
        LIMITS,
        "Vision-language models: images one request may hold (0: none).",
    ),
]
MaxImagePixels = Annotated[
    int | None,
    _opt(
        "max_image_pixels",
        LIMITS,
        "Vision-language models: pixels (width x height) an image may have, checked before it "
        "is decoded.",
    ),
]
MaxImageBytes = Annotated[
    int | None,
    _opt(
        "max_image_bytes",
        LIMITS,
        "Vision-language models: encoded bytes an image may have (a data URL's, or a fetched "
        "body's).",
    ),
]
HeaderTimeoutS = Annotated[
    float | None,
    _opt(
        "header_timeout_s",
        SERVER,
        "Seconds a request's headers may take to arrive; slower clients get 408 and are "
        "disconnected.",
    ),
]
BodyTimeoutS = Annotated[
    float | None,
    _opt(
        "body_timeout_s",
        SERVER,
        "Seconds a request's body may take to arrive after its headers; slower clients get "
        "408 and are disconnected.",
    ),
]
KeepAliveTimeoutS = Annotated[
    float | None,
    _opt(
        "keep_alive_timeout_s",
        SERVER,
        "Seconds an idle keep-alive connection stays open between requests.",
    ),
]
PrefixStorePath = Annotated[
    str | None,
    _opt(
        "prefix_store_path",
        MODEL,
        "Directory of tuned prompt prefixes: one directory per prefix_id (decoder.pt, or a "
        "PEFT prompt-tuning adapter); cpu/cuda.",
        "none",
    ),
]
LoraAdapters = Annotated[
    str | None,
    _opt(
        "lora_adapters",
        MODEL,
        "PEFT LoRA adapters requests may select (adapter_id; OpenAI's model; gRPC's "
        "adapter_id): name=path pairs (a directory or a cached Hub id), separated by commas; "
        "cpu/cuda paged engine.",
        "none",
    ),
]
LoraAdapterDir = Annotated[
    str | None,
    _opt(
        "lora_adapter_dir",
        MODEL,
        "Directory of LoRA adapters loaded on demand: adapter_id NAME is the adapter in DIR/NAME.",
        "none",
    ),
]
MaxLoras = Annotated[
    int | None,
    _opt("max_loras", MODEL, "LoRA adapters kept loaded (least recently used first out).", "8"),
]
MaxLoraRank = Annotated[
    int | None,
    _opt(
        "max_lora_rank", MODEL, "The largest LoRA rank served; larger adapters are refused.", "64"
    ),
]
OutputSpecialTokens = Annotated[
    bool | None,
    _opt("output_special_tokens", SERVER, "gRPC: keep special tokens in the output text.", "off"),
]
DefaultIncludeStopSeqs = Annotated[
    str | None,
    _opt(
        "default_include_stop_seqs",
        SERVER,
        "gRPC: keep a matched stop sequence in the text when a request does not say.",
        "true",
        metavar="BOOL",
    ),
]


KvCacheDtype = Annotated[
    str | None,
    _opt(
        "kv_cache_dtype",
        DEVICE,
        "cpu/cuda, paged engine: the KV cache's dtype: auto (the model's), fp8_e4m3fn or "
        "fp8_e5m2 (a byte per value, each rounded on write; attention through plain torch).",
        "auto",
    ),
]

# Every launcher option, in the order --help lists them.
OPTIONS: dict[str, Any] = {
    "model_id": ModelId,
    "revision": Revision,
    "backend": Backend,
    "dtype": Dtype,
    "num_shard": NumShard,
    "sharded": Sharded,
    "master_addr": MasterAddr,
    "master_port": MasterPort,
    "nnodes": Nnodes,
    "node_rank": NodeRank,
    "socket_ifname": SocketIfname,
    "join_timeout_s": JoinTimeoutS,
    "node_timeout_s": NodeTimeoutS,
    "prefill_mode": PrefillMode,
    "model_impl": ModelImpl,
    "attention_backend": AttentionBackend,
    "quantize": Quantize,
    "quantize_group_size": QuantizeGroupSize,
    "kv_cache_dtype": KvCacheDtype,
    "compile_cache": CompileCache,
    "compile": Compile,
    "cuda_graphs": CudaGraphs,
    "async_scheduling": AsyncScheduling,
    "prefix_caching": PrefixCaching,
    "speculate": Speculate,
    "draft_model": DraftModel,
    "rerank_tokens": RerankTokens,
    "rerank_template": RerankTemplate,
    "cuda_memory_fraction": CudaMemoryFraction,
    "max_concurrent_requests": MaxConcurrentRequests,
    "max_best_of": MaxBestOf,
    "max_stop_sequences": MaxStopSequences,
    "max_top_n_tokens": MaxTopNTokens,
    "max_input_tokens": MaxInputTokens,
    "max_input_length": MaxInputLength,
    "max_total_tokens": MaxTotalTokens,
    "max_batch_prefill_tokens": MaxBatchPrefillTokens,
    "max_batch_total_tokens": MaxBatchTotalTokens,
    "max_batch_size": MaxBatchSize,
    "max_waiting_tokens": MaxWaitingTokens,
    "waiting_served_ratio": WaitingServedRatio,
    "port": Port,
    "hostname": Hostname,
    "api_key": ApiKey,
    "cors_allow_origin": CorsAllowOrigin,
    "playground": Playground,
    "grpc": Grpc,
    "grpc_port": GrpcPort,
    "tls_cert_path": TlsCertPath,
    "tls_key_path": TlsKeyPath,
    "tls_client_ca_cert_path": TlsClientCaCertPath,
    "max_new_tokens": MaxNewTokens,
    "output_special_tokens": OutputSpecialTokens,
    "default_include_stop_seqs": DefaultIncludeStopSeqs,
    "prefix_store_path": PrefixStorePath,
    "lora_adapters": LoraAdapters,
    "lora_adapter_dir": LoraAdapterDir,
    "max_loras": MaxLoras,
    "max_lora_rank": MaxLoraRank,
    "max_request_body_bytes": MaxRequestBodyBytes,
    "max_stored_responses": MaxStoredResponses,
    "allow_image_urls": AllowImageUrls,
    "max_images_per_request": MaxImagesPerRequest,
    "max_image_pixels": MaxImagePixels,
    "max_image_bytes": MaxImageBytes,
    "header_timeout_s": HeaderTimeoutS,
    "body_timeout_s": BodyTimeoutS,
    "keep_alive_timeout_s": KeepAliveTimeoutS,
    "model_name": ModelName,
    "max_sequence_length": MaxSequenceLength,
    "dtype_str": DtypeStr,
}
# What warmup needs: the model, the device and the limits that shape the batch.
WARMUP_OPTIONS = (
    "model_id",
    "model_name",
    "dtype_str",
    "max_sequence_length",
    "revision",
    "backend",
    "dtype",
    "num_shard",
    "sharded",
    "master_addr",
    "master_port",
    "prefill_mode",
    "model_impl",
    "attention_backend",
    "quantize",
    "quantize_group_size",
    "kv_cache_dtype",
    "compile_cache",
    "compile",
    "cuda_graphs",
    "async_scheduling",
    "cuda_memory_fraction",
    "max_concurrent_requests",
    "max_input_tokens",
    "max_input_length",
    "max_total_tokens",
    "max_batch_prefill_tokens",
    "max_batch_total_tokens",
    "max_batch_size",
)

Command = TypeVar("Command", bound=Callable[..., Any])


def launcher_options(*names: str) -> Callable[[Command], Command]:
    """Give a command the launcher options `names` (all of them when none are named) ahead of
    its own parameters; it receives them as keyword arguments (`**launcher`)."""
    picked = names or tuple(OPTIONS)
    unknown = [n for n in picked if n not in OPTIONS]
    if unknown:
        raise ValueError(f"not launcher options: {', '.join(unknown)}")

    def decorate(func: Command) -> Command:
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(func, eval_str=True).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        shared = [
            inspect.Parameter(
                n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=OPTIONS[n]
            )
            for n in picked
        ]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            return func(**kwargs)

        command.__signature__ = inspect.Signature(shared + own)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in shared + own}
        return command  # type: ignore[return-value]

    return decorate


NoDownload = Annotated[
    bool,
    typer.Option(
        "--no-download",
        help="Never fetch the model: one missing from the Hugging Face cache is an error "
        "(as with HF_HUB_OFFLINE=1). By default it is downloaded as `tgis download-weights` "
        "does.",
        rich_help_panel=MODEL,
    ),
]


def launcher_args(values: dict[str, Any]) -> LauncherArgs:
    """The LauncherArgs of the launcher options a command received (`**launcher`)."""
    from tgis.config import parse_bool

    picked = dict(values)
    for name in ("sharded", "default_include_stop_seqs"):
        if isinstance(picked.get(name), str):
            picked[name] = parse_bool("--" + name.replace("_", "-"), picked[name])
    return LauncherArgs(**picked)


def resolve_launcher_config(
    values: dict[str, Any], download: bool = True
) -> tuple[ServeConfig, Path, ModelFacts]:
    """Flags -> model facts -> validated ServeConfig, the model's local directory and its
    facts (which the backend chooser reads too). A Hub model missing from the cache is
    downloaded first unless `download` is False (hub.serving_model_dir)."""
    from tgis.backends.registry import detect_backend
    from tgis.config import build_serve_config, default_env, model_reference
    from tgis.hub import read_model_facts, serving_model_dir

    args = launcher_args(values)
    env = default_env()
    model_id, revision = model_reference(args, env)
    model_dir = serving_model_dir(model_id, revision, download)
    facts = read_model_facts(model_dir)
    return build_serve_config(args, facts, env, detect_backend), model_dir, facts
