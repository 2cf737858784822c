"""The neuron backend: the static batch (seed 002) over optimum-neuron 0.4's NxD decoder models.

A `NeuronModelForCausalLM` (optimum/neuron/models/inference/backend/modules/decoder/
modeling_decoder.py, `NxDModelForCausalLM`, at optimum-neuron v0.4.5) holds its own KV cache of
`batch_size` rows x `sequence_length` positions on the Neuron cores and is driven through one
method, `forward(input_ids, position_ids, seq_ids, sampling_params)`, which picks a compiled graph:

- context encoding when `input_ids` has more than one column and `position_ids.min() == 0`:
  right-padded prompts from position 0, padded by the wrapper to `max_context_length`. With
  `continuous_batching` its batch is 1 (`ctx_batch_size`) and it writes the cache row `seq_ids[0]`
  only; without, its batch is `batch_size` and it rewrites rows [0, batch_size). The logits are
  taken at the column of the largest position id.
- token generation otherwise: one token per cache row, written at that row's `position_ids`
  and attending to positions [0, position). Row i of the batch is cache row i (the wrapper sorts
  by `seq_ids`), and a call with fewer rows than `batch_size` is padded with copies of its first
  row, which would write into the other rows: every call here passes all `batch_size` rows.

Without on-device sampling the output is float logits [b, 1, vocab]; with it, sampled tokens
[b]. tgis samples on the host, so a model compiled with on-device sampling is refused.

How the static batch maps onto it (see static/batch.py for the backend side):
- a prompt of 2+ tokens runs the context-encoding graph, one sequence per call when the model
  batches continuously (prefill mode "insert"), the whole batch at once otherwise ("rebuild");
  inputs are padded here to `max_context_length` with position id 0, so the last real token
  is the only column holding the largest position id;
- a one-token prompt cannot use that graph (one column selects token generation): it runs a
  token-generation step at position 0 of its row;
- rows not being fed in a token-generation step (padding, free slots, one-token prefills'
  neighbours) compute at position `sequence_length - 1`: at or past every live sequence's next
  position, so the value written there is overwritten before any step reads it.

Prompt logits (decoder_input_details) are not available: the compiled graphs return the last
position's logits only.

Compilation happens at export (`tgis export-neuron`, or here at start-up for a model directory
that is not exported yet); the runtime takes host tensors, so there is nothing to sync.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from tgis import neuron_export
from tgis.backends.common.kv import kv_bytes_per_token as shared_kv_bytes_per_token
from tgis.backends.static.batch import StaticBatchBackend, pad_token_id
from tgis.backends.static.buckets import PrefillMode, static_policy
from tgis.config import NeuronExport, ServeConfig, StaticShape
from tgis.errors import BackendUnavailableError, ConfigError

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_UNAVAILABLE = (
    "prompt logprobs (decoder_input_details) are not available on the neuron backend"
)
# Modules the backend imports: optimum-neuron, and the Neuron runtime its NxD models run on.
REQUIRED_MODULES = ("optimum.neuron", "neuronx_distributed")
DEFAULT_EXPORT_ROOT = Path.home() / ".cache" / "tgis" / "neuron"


class NeuronModel(Protocol):
    """What this module uses of optimum-neuron 0.4's `NeuronModelForCausalLM` (NxD models)."""

    config: Any
    neuron_config: Any

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor | None = None,
        sampling_params: torch.Tensor | None = None,
    ) -> Any: ...


class NeuronOps:
    """DeviceOps for Neuron: inputs stay on the host (the Neuron runtime takes CPU tensors), a
    step has already run when `forward` returns, and graphs are compiled at export."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.name = "neuron"

    def sync(self) -> None:
        """Nothing to do: the runtime call is synchronous."""

    def compilations(self) -> int:
        """0: the graphs were compiled when the model was exported."""
        return 0


def supports_insert(model: NeuronModel) -> bool:
    """Whether the compiled model can prefill given slots while the others keep their KV: a
    context-encoding graph that writes one `seq_ids` row (continuous batching), or a batch of 1."""
    config = model.neuron_config
    return bool(getattr(config, "continuous_batching", False)) or int(config.batch_size) == 1


def choose_prefill_mode(requested: str | None, model: NeuronModel) -> PrefillMode:
    """`requested` (--prefill-mode) when the model allows it, else insert where supported."""
    insert = supports_insert(model)
    if requested is None:
        return "insert" if insert else "rebuild"
    if requested not in ("insert", "rebuild"):
        raise ConfigError(
            f"--prefill-mode {requested!r} is not a prefill mode", "use insert or rebuild"
        )
    if requested == "insert" and not insert:
        raise ConfigError(
            f"--prefill-mode insert needs a Neuron model compiled with continuous batching; this "
            f"one has batch_size={model.neuron_config.batch_size} without it",
            "use --prefill-mode rebuild, or re-export the model with batch_size > 1",
        )
    return "insert" if requested == "insert" else "rebuild"


def kv_bytes_per_token(hf_config: Any, dtype: Any) -> int:
    """K and V bytes of one token over all layers, from the model config (the compiled cache
    may hold more KV heads: optimum-neuron replicates them to divide over the cores)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return shared_kv_bytes_per_token(int(text.num_hidden_layers), kv_heads, head_dim, dtype)


class NeuronStaticModel:
    """The `StaticModel` of static/batch.py over a loaded NeuronModelForCausalLM."""

    def __init__(self, model: NeuronModel, pad_token_id: int = 0) -> None:
        config = model.neuron_config
        if getattr(config, "on_device_sampling", False):
            raise ConfigError(
                "the Neuron model was compiled with on-device sampling: it returns sampled "
                "tokens, and tgis needs logits to sample on the host",
                "re-export the model with on_device_sampling disabled in its neuron config",
            )
        self.model = model
        self.batch_size = int(config.batch_size)
        self.sequence_length = int(config.sequence_length)
        self.context_length = int(
            getattr(config, "max_context_length", None) or self.sequence_length
        )
        self.continuous_batching = bool(getattr(config, "continuous_batching", False))
        text = (
            model.config.get_text_config()
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        self.vocab_size = int(text.vocab_size)
        self.kv_bytes_per_token = kv_bytes_per_token(
            model.config, getattr(config, "torch_dtype", None)
        )
        self.pad_token_id = pad_token_id
        # The scratch position of rows a token-generation step does not feed (see module doc).
        self.scratch_position = self.sequence_length - 1

    @property
    def context_batch_size(self) -> int:
        """Rows of the context-encoding graph: 1 with continuous batching, else batch_size."""
        return 1 if self.continuous_batching else self.batch_size

    def _sampling_params(self, rows: int) -> torch.Tensor:
        """[rows, 3] (top_k, top_p, temperature): a graph input, unused without on-device
        sampling."""
        return torch.tensor([[1.0, 1.0, 1.0]] * rows, dtype=torch.float32)

    def _logits(self, output: Any, rows: int) -> torch.Tensor:
        """forward's output -> float32 logits [rows, vocab]."""
        if isinstance(output, (list, tuple)):
            output = output[0]
        if output.dim() == 3:
            output = output[:, -1, :]
        if output.dim() != 2 or output.shape[0] != rows:
            raise RuntimeError(
                f"the Neuron model returned {tuple(output.shape)}, expected [{rows}, 1, vocab] logits"
            )
        return output[:, : self.vocab_size].float()

    def _context(self, prompts: Sequence[Sequence[int]], rows: Sequence[int]) -> torch.Tensor:
        """One context-encoding call: prompts (2+ tokens) into cache `rows` -> [len, vocab]."""
        width = self.context_length
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
            positions[i, : len(prompt)] = torch.arange(len(prompt))
        output = self.model.forward(
            input_ids=ids,
            position_ids=positions,
            seq_ids=torch.tensor(list(rows), dtype=torch.long),
            sampling_params=self._sampling_params(len(prompts)),
        )
        return self._logits(output, len(prompts))

    def _generate(self, fed: dict[int, tuple[int, int]]) -> torch.Tensor:
        """One token-generation step over every row: `fed` maps row -> (token, position); the
        other rows compute a pad token at the scratch position. Returns [batch_size, vocab]."""
        ids = torch.full((self.batch_size, 1), self.pad_token_id, dtype=torch.long)
        positions = torch.full((self.batch_size, 1), self.scratch_position, dtype=torch.long)
        for row, (token, position) in fed.items():
            ids[row, 0], positions[row, 0] = token, position
        output = self.model.forward(
            input_ids=ids,
            position_ids=positions,
            seq_ids=torch.arange(self.batch_size),
            sampling_params=self._sampling_params(self.batch_size),
        )
        return self._logits(output, self.batch_size)

    @torch.no_grad()
    def prefill_static(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        rows: torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Right-padded prompts [b, L] of `lengths` into cache `rows` (== batch_size: padding,
        skipped) -> float32 logits [b, vocab] after each prompt's last token (zeros for padding)."""
        if all_logits:
            raise ValueError(PROMPT_LOGPROBS_UNAVAILABLE)
        ids, sizes, targets = input_ids.cpu().tolist(), lengths.cpu().tolist(), rows.cpu().tolist()
        out = torch.zeros((len(targets), self.vocab_size), dtype=torch.float32)
        real = [i for i, row in enumerate(targets) if row != self.batch_size]
        for i in real:
            if not 0 <= targets[i] < self.batch_size or not 0 < sizes[i] <= self.context_length:
                raise ValueError(
                    f"prefill row {targets[i]} of {sizes[i]} tokens is outside the compiled "
                    f"{self.batch_size} rows x {self.context_length} context positions"
                )
        prompts = {i: ids[i][: sizes[i]] for i in real}
        long = [i for i in real if sizes[i] > 1]
        if long and self.continuous_batching:
            for i in long:
                out[i] = self._context([prompts[i]], [targets[i]])[0]
        elif long:
            # One call rewrites every row: it must hold every row's tokens, in row order.
            if sorted(targets[i] for i in real) != list(range(self.batch_size)):
                raise ValueError(
                    f"this Neuron model prefills all {self.batch_size} rows at once (no continuous "
                    f"batching): rows {targets} must cover them (prefill mode rebuild)"
                )
            order = sorted(real, key=lambda i: targets[i])
            logits = self._context([prompts[i] for i in order], [targets[i] for i in order])
            for k, i in enumerate(order):
                out[i] = logits[k]
        single = [i for i in real if sizes[i] == 1]
        if single:
            # Token generation at position 0 (after any context call: that one may rewrite rows).
            logits = self._generate({targets[i]: (prompts[i][0], 0) for i in single})
            for i in single:
                out[i] = logits[targets[i]]
        return out

    @torch.no_grad()
    def decode_static(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """One token per cache row [0, rows) at `positions` -> float32 logits [rows, vocab].
        The compiled step always runs batch_size rows: rows past `rows` compute at the scratch
        position."""
        if not 0 < rows <= self.batch_size:
            raise ValueError(f"decode of {rows} rows, the Neuron model has {self.batch_size}")
        tokens, where = input_ids.cpu().tolist(), positions.cpu().tolist()
        logits = self._generate({row: (tokens[row], where[row]) for row in range(rows)})
        return logits[:rows]


def _import_optimum_neuron() -> Any:
    """optimum-neuron's NeuronModelForCausalLM, or BackendUnavailableError (one line)."""
    missing = []
    for name in REQUIRED_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise BackendUnavailableError(
            f"the neuron backend needs {', '.join(missing)} (optimum-neuron and the Neuron SDK), "
            "not installed here",
            neuron_export.INSTALL_HINT,
        )
    module = importlib.import_module("optimum.neuron")
    try:
        return module.NeuronModelForCausalLM
    except (AttributeError, ImportError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BackendUnavailableError(
            f"optimum.neuron has no usable NeuronModelForCausalLM ({first})",
            neuron_export.INSTALL_HINT,
        ) from None


def _exported_shape(model_dir: Path) -> NeuronExport | None:
    from tgis.hub import read_model_facts

    return read_model_facts(model_dir).neuron


def default_export_dir(
    model_dir: Path, shape: StaticShape, root: Path = DEFAULT_EXPORT_ROOT
) -> Path:
    """Where a model compiled at start-up is kept: one directory per (model, shape) under
    `root` (--compile-cache, else ~/.cache/tgis/neuron)."""
    digest = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:10]
    name = (
        f"{Path(model_dir).name}-{digest}-b{shape.batch_size}-s{shape.sequence_length}"
        f"-tp{shape.num_cores}-{shape.auto_cast_type}"
    )
    return root / name


def ensure_exported(config: ServeConfig, model_dir: Path, export_dir: Path | None = None) -> Path:
    """The directory of a compiled model: `model_dir` when it is exported, else the result of
    compiling it (tgis.neuron_export.export) for config.static_shape, reused when present:
    `export_dir`, else a directory per (model, shape) under --compile-cache or
    ~/.cache/tgis/neuron."""
    if _exported_shape(model_dir) is not None:
        return model_dir
    shape = config.static_shape
    if shape is None or shape.num_cores is None or shape.auto_cast_type is None:
        raise ConfigError(
            f"{model_dir} is not exported for Neuron and no export shape is configured",
            "set HF_BATCH_SIZE, HF_SEQUENCE_LENGTH, HF_NUM_CORES and HF_AUTO_CAST_TYPE, or run "
            "tgis export-neuron first",
        )
    root = Path(config.compile_cache) if config.compile_cache else DEFAULT_EXPORT_ROOT
    output = export_dir or default_export_dir(model_dir, shape, root)
    wanted = (shape.batch_size, shape.sequence_length, shape.num_cores)
    if (output / "config.json").is_file():
        done = _exported_shape(output)
        if done is not None and (done.batch_size, done.sequence_length, done.num_cores) == wanted:
            logger.info("using the Neuron model compiled earlier in %s", output)
            return output
    logger.info(
        "compiling %s for Neuron (batch %d x %d tokens, %d cores, %s) into %s",
        model_dir,
        shape.batch_size,
        shape.sequence_length,
        shape.num_cores,
        shape.auto_cast_type,
        output,
    )
    request = neuron_export.ExportRequest(
        model_dir,
        output,
        shape.batch_size,
        shape.sequence_length,
        shape.num_cores,
        shape.auto_cast_type,
    )
    neuron_export.export(request)
    return output


def resolve_pad_token_id(model_dir: Path, hf_config: Any) -> int:
    """The tokenizer's pad id, else the config's, else EOS (tokenizer, then config), else 0."""
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception:  # any tokenizer failure: fall back to the config
        logger.debug("no tokenizer in %s for the pad token", model_dir)
    return pad_token_id(hf_config, tokenizer)


def load_neuron_backend(
    config: ServeConfig, model_dir: Path, export_dir: Path | None = None
) -> StaticBatchBackend:
    """Load (compiling first when needed) the Neuron model of `model_dir` as a static batch."""
    model_class = _import_optimum_neuron()
    shape = config.static_shape
    if shape is None:
        raise ConfigError(
            "the neuron backend needs a static shape", "serve with --backend neuron validated"
        )
    compiled_dir = ensure_exported(config, Path(model_dir), export_dir)
    if not (compiled_dir / "neuron_config.json").is_file():
        # A `neuron` section in config.json is the format of optimum-neuron before 0.1 (the
        # NeuronX TGI images' Hub models); 0.4's loader reads neuron_config.json only.
        raise ConfigError(
            f"{compiled_dir} was compiled by an older optimum-neuron (a `neuron` section in "
            "config.json, no neuron_config.json), which optimum-neuron 0.4.5 cannot load",
            "re-export the original checkpoint with `tgis export-neuron`, or serve the "
            "original model id to compile it at start-up",
        )
    model = model_class.from_pretrained(str(compiled_dir))
    neuron_config = model.neuron_config
    found = (int(neuron_config.batch_size), int(neuron_config.sequence_length))
    if found != (shape.batch_size, shape.sequence_length):
        raise ConfigError(
            f"the Neuron model in {compiled_dir} is compiled for batch_size={found[0]} x "
            f"sequence_length={found[1]}, but the server is configured for batch_size="
            f"{shape.batch_size} x sequence_length={shape.sequence_length} ({shape.source})",
            "drop the HF_* / --max-batch-size / --max-total-tokens overrides, or re-export the model",
        )
    mode = choose_prefill_mode(config.prefill_mode, model)
    policy = static_policy(shape.batch_size, shape.sequence_length, config.max_input_tokens, mode)
    pad_id = resolve_pad_token_id(compiled_dir, model.config)
    static_model = NeuronStaticModel(model, pad_id)
    if policy.prefill_lengths[-1] > static_model.context_length:
        raise ConfigError(
            f"{mode} prefills reach {policy.prefill_lengths[-1]} tokens but the Neuron model's "
            f"context encoding holds {static_model.context_length} (max_context_length)",
            "lower --max-input-tokens, use --prefill-mode insert, or re-export the model",
        )
    logger.info(
        "neuron: batch %d x %d tokens, prefill mode %s, continuous batching %s",
        shape.batch_size,
        shape.sequence_length,
        mode,
        static_model.continuous_batching,
    )
    # The compiled graphs return the last position's logits only: the server refuses
    # decoder_input_details with 422 before a request is queued.
    return StaticBatchBackend(
        static_model, policy, NeuronOps(), "neuron", pad_id, prompt_logprobs=False
    )
