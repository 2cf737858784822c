"""The neuron backend on the CPU, against a fake of optimum-neuron 0.4.5's NeuronModelForCausalLM.

`FakeNeuronModel` follows the NxD decoder models as read in huggingface/optimum-neuron at tag
v0.4.5:
- optimum/neuron/models/inference/backend/modules/decoder/modeling_decoder.py
  (`NxDModelForCausalLM.forward(input_ids, position_ids, seq_ids, sampling_params)`: context
  encoding when input_ids has more than one column and position_ids.min() == 0, token
  generation otherwise; logits gathered at the column of the largest position id; float logits
  [b, 1, vocab] without on-device sampling),
- .../decoder/decoder_wrappers.py (context inputs right-padded to max_context_length with the
  pad token and position id 1; token-generation rows sorted by seq_ids),
- .../kvcache/kv_cache_manager.py (context encoding writes row seq_ids[0] only with continuous
  batching, rows [0, batch) otherwise; token generation writes each row at its position id),
- .../backend/config.py (`NxDNeuronConfig`: batch_size, sequence_length, max_context_length,
  continuous_batching, on_device_sampling, ctx_batch_size = 1 with continuous batching).

It keeps, per cache row and position, the token whose KV the device would hold there (or a
garbage marker where KV was computed for padding at a wrong position) and answers each row with
the logits the tiny HF llama gives for that row's history: what a correct KV-cached device model
returns. A row whose history touches garbage or unwritten positions gets NaN logits. It also
asserts the call shapes the compiled graphs accept.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, VOCAB, greedy_reference
from tests.backends.scenarios import alone_run, random_prompts, staggered_greedy
from tgis import neuron_export
from tgis.backends.static import neuron
from tgis.backends.static.batch import StaticBatchBackend
from tgis.backends.static.buckets import static_policy
from tgis.backends.static.neuron import (
    PROMPT_LOGPROBS_UNAVAILABLE,
    NeuronOps,
    NeuronStaticModel,
    choose_prefill_mode,
    load_neuron_backend,
    supports_insert,
)
from tgis.config import LauncherArgs, ModelFacts, NeuronExport, ServeConfig, build_serve_config
from tgis.engine.backend import PrefillItem
from tgis.errors import BackendUnavailableError, ConfigError

GARBAGE = -1
PAD = 3
SEQ_LEN = 64


class FakeNeuronConfig:
    """The fields of optimum-neuron's NxDNeuronConfig that serving reads."""

    def __init__(
        self,
        batch_size: int,
        sequence_length: int = SEQ_LEN,
        continuous_batching: bool | None = None,
        on_device_sampling: bool = False,
        max_context_length: int | None = None,
        tp_degree: int = 2,
        torch_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.batch_size = batch_size
        self.max_batch_size = batch_size
        self.sequence_length = sequence_length
        # optimum-neuron's _get_neuron_config default: continuous batching when batch_size > 1.
        self.continuous_batching = (
            batch_size > 1 if continuous_batching is None else continuous_batching
        )
        self.on_device_sampling = on_device_sampling
        self.output_logits = False
        self.max_context_length = max_context_length or sequence_length
        self.tp_degree = tp_degree
        self.torch_dtype = torch_dtype
        self.speculation_length = 0

    @property
    def ctx_batch_size(self) -> int:
        return 1 if self.continuous_batching else self.batch_size

    @property
    def tkg_batch_size(self) -> int:
        return self.batch_size


class FakeNeuronModel:
    """A KV-cached device model with NeuronModelForCausalLM's call surface (see module doc)."""

    def __init__(self, hf_model: PreTrainedModel, neuron_config: FakeNeuronConfig) -> None:
        self.hf_model = hf_model
        self.config = hf_model.config
        self.neuron_config = neuron_config
        self.vocab_size = hf_model.config.vocab_size
        size, length = neuron_config.batch_size, neuron_config.sequence_length
        self.cache: list[list[int | None]] = [[None] * length for _ in range(size)]
        self.calls: list[tuple[str, int, int]] = []  # (graph, rows, columns)

    @classmethod
    def from_pretrained(cls, model_id: str | Path, **kwargs: Any) -> FakeNeuronModel:
        raise NotImplementedError("bound per test by fake_optimum_neuron")

    def _logits_for(self, history: list[int | None]) -> torch.Tensor:
        if any(t is None or t == GARBAGE for t in history):
            return torch.full((self.vocab_size,), float("nan"))
        with torch.no_grad():
            out = self.hf_model(torch.tensor([history]))
        return out.logits[0, -1].float()

    def forward(
        self,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        seq_ids: torch.LongTensor | None = None,
        sampling_params: torch.FloatTensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> torch.Tensor:
        config = self.neuron_config
        assert input_ids.dtype == torch.long and position_ids.shape == input_ids.shape
        assert seq_ids is not None and seq_ids.shape == (input_ids.shape[0],)
        assert sampling_params is not None and sampling_params.shape == (input_ids.shape[0], 3)
        assert not (output_attentions or output_hidden_states or return_dict)
        if input_ids.shape[-1] > 1 and not position_ids.min().item():
            return self._context_encoding(input_ids, position_ids, seq_ids)
        assert input_ids.shape[-1] == 1, "several tokens from a non-zero position: speculation"
        # Padding a short batch would copy row 0's position into the other rows' cache lines.
        assert input_ids.shape[0] == config.tkg_batch_size, "token generation runs every row"
        assert sorted(seq_ids.tolist()) == list(range(config.batch_size))
        self.calls.append(("token_generation", input_ids.shape[0], 1))
        order = torch.argsort(seq_ids)
        logits = torch.empty((config.batch_size, 1, self.vocab_size))
        for i in order.tolist():
            row, token, position = int(seq_ids[i]), int(input_ids[i, 0]), int(position_ids[i, 0])
            assert 0 <= position < config.sequence_length
            history = [*self.cache[row][:position], token]
            logits[i, 0] = self._logits_for(history)
            self.cache[row][position] = token
        return logits

    def _context_encoding(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, seq_ids: torch.Tensor
    ) -> torch.Tensor:
        config = self.neuron_config
        batch, width = input_ids.shape
        assert width <= config.max_context_length
        assert batch == config.ctx_batch_size, "context encoding runs its compiled batch"
        if config.continuous_batching:
            rows = seq_ids.tolist()  # "only supports single seq_id"
        else:
            # fill_prefix writes rows [0, batch) whatever seq_ids say.
            assert seq_ids.tolist() == list(range(batch))
            rows = list(range(batch))
        assert all(0 <= r < config.batch_size for r in rows), "a padding row reached the device"
        self.calls.append(("context_encoding", batch, width))
        pad = config.max_context_length - width
        ids = torch.nn.functional.pad(input_ids, (0, pad), value=PAD)
        positions = torch.nn.functional.pad(position_ids, (0, pad), value=1)
        last = torch.max(positions, dim=1).indices
        logits = torch.empty((batch, 1, self.vocab_size))
        for i, row in enumerate(rows):
            entries: list[int | None] = [
                int(t) if int(p) == j else GARBAGE
                for j, (t, p) in enumerate(zip(ids[i], positions[i], strict=True))
            ]
            logits[i, 0] = self._logits_for(entries[: int(last[i]) + 1])
            self.cache[row][: config.max_context_length] = entries
        return logits


@pytest.fixture(scope="module")
def llama(tiny_lm: Callable[..., PreTrainedModel]) -> PreTrainedModel:
    return tiny_lm("llama")


def fake_backend(
    hf_model: PreTrainedModel,
    batch_size: int,
    mode: str,
    continuous_batching: bool | None = None,
    max_input_tokens: int = 24,
) -> tuple[StaticBatchBackend, FakeNeuronModel]:
    fake = FakeNeuronModel(hf_model, FakeNeuronConfig(batch_size, SEQ_LEN, continuous_batching))
    policy = static_policy(batch_size, SEQ_LEN, max_input_tokens, mode)  # type: ignore[arg-type]
    backend = StaticBatchBackend(
        NeuronStaticModel(fake, PAD), policy, NeuronOps(), "neuron", PAD, prompt_logprobs=False
    )  # as load_neuron_backend builds it
    return backend, fake


def greedy(backend: StaticBatchBackend, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    tokens, logits = alone_run(backend, prompt, new_tokens)
    assert all(bool(torch.isfinite(row).all()) for row in logits)
    return tokens


# (batch, mode, continuous batching): the layouts a Neuron export can have.
LAYOUTS = [
    pytest.param(4, "insert", True, id="cb-insert"),
    pytest.param(4, "rebuild", True, id="cb-rebuild"),
    pytest.param(4, "rebuild", False, id="static-rebuild"),
    pytest.param(1, "insert", False, id="batch1-insert"),
]


@pytest.mark.parametrize(("batch", "mode", "cb"), LAYOUTS)
def test_greedy_matches_generate(llama: PreTrainedModel, batch: int, mode: str, cb: bool) -> None:
    backend, fake = fake_backend(llama, batch, mode, cb)
    for prompt in (*PROMPTS, (77,)):
        assert greedy(backend, prompt, 8) == greedy_reference(llama, prompt, 8)
    graphs = {call[0] for call in fake.calls}
    assert graphs == {"context_encoding", "token_generation"}


@pytest.mark.parametrize(("batch", "mode", "cb"), LAYOUTS[:3])
def test_joining_and_leaving_sequences_get_their_alone_tokens(
    llama: PreTrainedModel, batch: int, mode: str, cb: bool
) -> None:
    prompts, budgets = random_prompts(7, seed=3, vocab=VOCAB, max_len=20, max_new=10)
    prompts[2] = (41,)  # a one-token prompt joins while others run
    backend, _ = fake_backend(llama, batch, mode, cb)
    alone = [alone_run(backend, p, n)[0] for p, n in zip(prompts, budgets, strict=True)]
    joins = {0: [0, 1], 2: [2], 3: [3], 9: [4, 5], 14: [6]}
    tokens, logits = staggered_greedy(backend, prompts, budgets, joins)
    for seq_id in range(len(prompts)):
        assert tokens[seq_id] == alone[seq_id], f"sequence {seq_id}"
        assert all(bool(torch.isfinite(row).all()) for row in logits[seq_id])
    assert backend.running == 0


def test_insert_prefills_one_sequence_per_call_and_decode_runs_every_row(
    llama: PreTrainedModel,
) -> None:
    backend, fake = fake_backend(llama, 4, "insert", True)
    out = backend.prefill([PrefillItem(10, PROMPTS[0]), PrefillItem(11, PROMPTS[1])])
    assert fake.calls == [("context_encoding", 1, SEQ_LEN)] * 2
    fake.calls.clear()
    backend.decode([11], [int(out.last[1].argmax())])
    assert fake.calls == [("token_generation", 4, 1)]
    # Row 0 was not fed: its prompt's KV is intact (its next position holds a pad until fed).
    assert fake.cache[0][: len(PROMPTS[0])] == list(PROMPTS[0])
    assert fake.cache[1][: len(PROMPTS[1]) + 1] == [*PROMPTS[1], int(out.last[1].argmax())]


def test_one_token_prompt_uses_token_generation_and_keeps_other_rows(
    llama: PreTrainedModel,
) -> None:
    backend, fake = fake_backend(llama, 4, "insert", True)
    first = backend.prefill([PrefillItem(0, PROMPTS[2])])
    before = list(fake.cache[0][: len(PROMPTS[2])])
    fake.calls.clear()
    out = backend.prefill([PrefillItem(1, (77,))])
    assert fake.calls == [("token_generation", 4, 1)]
    assert fake.cache[0][: len(PROMPTS[2])] == before
    assert int(out.last[0].argmax()) == greedy_reference(llama, (77,), 1)[0]
    token = int(first.last[0].argmax())
    assert (
        int(backend.decode([0], [token])[0].argmax()) == greedy_reference(llama, PROMPTS[2], 2)[1]
    )


def test_decode_with_fewer_rows_pads_to_the_compiled_batch(llama: PreTrainedModel) -> None:
    fake = FakeNeuronModel(llama, FakeNeuronConfig(4))
    model = NeuronStaticModel(fake, PAD)
    model.prefill_static(torch.tensor([[5, 6, 7]]), torch.tensor([3]), torch.tensor([0]))
    logits = model.decode_static(torch.tensor([8, PAD]), torch.tensor([3, 0]), 2)
    assert logits.shape == (2, VOCAB)
    expected = llama(torch.tensor([[5, 6, 7, 8]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)
    assert fake.calls[-1] == ("token_generation", 4, 1)


def test_prompt_logprobs_raise_a_clear_value_error(llama: PreTrainedModel) -> None:
    backend, fake = fake_backend(llama, 4, "insert", True)
    with pytest.raises(ValueError, match="prompt logprobs") as info:
        backend.prefill([PrefillItem(0, PROMPTS[0], prompt_logprobs=True)])
    assert str(info.value) == PROMPT_LOGPROBS_UNAVAILABLE
    assert fake.calls == [] and backend.running == 0
    assert greedy(backend, PROMPTS[0], 3) == greedy_reference(llama, PROMPTS[0], 3)


def test_static_model_reports_vocab_and_kv_bytes(llama: PreTrainedModel) -> None:
    fake = FakeNeuronModel(llama, FakeNeuronConfig(4, torch_dtype=torch.bfloat16))
    model = NeuronStaticModel(fake, PAD)
    cfg = llama.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert model.vocab_size == VOCAB
    assert model.kv_bytes_per_token == 2 * cfg.num_hidden_layers * 2 * head_dim * 2


def test_on_device_sampling_models_are_refused(llama: PreTrainedModel) -> None:
    fake = FakeNeuronModel(llama, FakeNeuronConfig(4, on_device_sampling=True))
    with pytest.raises(ConfigError, match="on-device sampling"):
        NeuronStaticModel(fake, PAD)


def test_prefill_mode_choice(llama: PreTrainedModel) -> None:
    cb = FakeNeuronModel(llama, FakeNeuronConfig(4))
    static = FakeNeuronModel(llama, FakeNeuronConfig(4, continuous_batching=False))
    single = FakeNeuronModel(llama, FakeNeuronConfig(1))
    assert (supports_insert(cb), supports_insert(static), supports_insert(single)) == (
        True,
        False,
        True,
    )
    assert choose_prefill_mode(None, cb) == "insert"
    assert choose_prefill_mode(None, static) == "rebuild"
    assert choose_prefill_mode("rebuild", cb) == "rebuild"
    with pytest.raises(ConfigError, match="continuous batching"):
        choose_prefill_mode("insert", static)


# --- load_neuron_backend ------------------------------------------------------------------


def write_model_dir(path: Path, llama: PreTrainedModel, shape: dict[str, Any] | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    llama.config.to_json_file(path / "config.json")
    if shape is not None:
        (path / "neuron_config.json").write_text(json.dumps(shape))
    return path


def serve_config(model_dir: Path, prefill_mode: str | None = None) -> ServeConfig:
    from tgis.hub import read_model_config

    facts = ModelFacts.from_config(*read_model_config(model_dir))
    env = {"HF_BATCH_SIZE": "4", "HF_SEQUENCE_LENGTH": str(SEQ_LEN), "HF_AUTO_CAST_TYPE": "fp32"}
    if facts.neuron is not None:
        env = {}
    args = LauncherArgs(model_id=str(model_dir), backend="neuron", prefill_mode=prefill_mode)
    return build_serve_config(args, facts, env)


EXPORTED = {"batch_size": 4, "sequence_length": SEQ_LEN, "tp_degree": 2, "torch_dtype": "float32"}


@pytest.fixture
def fake_optimum_neuron(
    monkeypatch: pytest.MonkeyPatch, llama: PreTrainedModel
) -> Callable[[FakeNeuronConfig], list[str]]:
    """Install fake `optimum.neuron` and `neuronx_distributed` modules whose
    NeuronModelForCausalLM.from_pretrained returns a FakeNeuronModel of the given config;
    returns the list of directories it loaded."""

    def install(config: FakeNeuronConfig) -> list[str]:
        loaded: list[str] = []

        class NeuronModelForCausalLM(FakeNeuronModel):
            @classmethod
            def from_pretrained(cls, model_id: str | Path, **kwargs: Any) -> FakeNeuronModel:
                loaded.append(str(model_id))
                return FakeNeuronModel(llama, config)

        optimum = types.ModuleType("optimum")
        module = types.ModuleType("optimum.neuron")
        module.NeuronModelForCausalLM = NeuronModelForCausalLM  # type: ignore[attr-defined]
        optimum.neuron = module  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "optimum", optimum)
        monkeypatch.setitem(sys.modules, "optimum.neuron", module)
        monkeypatch.setitem(sys.modules, "neuronx_distributed", types.ModuleType("nxd"))
        return loaded

    return install


def test_missing_optimum_neuron_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, llama: PreTrainedModel
) -> None:
    model_dir = write_model_dir(tmp_path / "m", llama, EXPORTED)
    monkeypatch.setitem(sys.modules, "optimum.neuron", None)
    with pytest.raises(BackendUnavailableError) as info:
        load_neuron_backend(serve_config(model_dir), model_dir)
    message = str(info.value)
    assert "\n" not in message
    assert "optimum.neuron" in message and "tgis[neuron]" in message


def test_missing_neuron_runtime_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    llama: PreTrainedModel,
    fake_optimum_neuron: Callable[[FakeNeuronConfig], list[str]],
) -> None:
    fake_optimum_neuron(FakeNeuronConfig(4))
    monkeypatch.setitem(sys.modules, "neuronx_distributed", None)
    model_dir = write_model_dir(tmp_path / "m", llama, EXPORTED)
    with pytest.raises(BackendUnavailableError) as info:
        load_neuron_backend(serve_config(model_dir), model_dir)
    message = str(info.value)
    assert "\n" not in message and "neuronx_distributed" in message
    assert "optimum.neuron," not in message


def test_load_exported_model_serves_greedy_tokens(
    tmp_path: Path,
    llama: PreTrainedModel,
    fake_optimum_neuron: Callable[[FakeNeuronConfig], list[str]],
) -> None:
    loaded = fake_optimum_neuron(FakeNeuronConfig(4))
    model_dir = write_model_dir(tmp_path / "m", llama, EXPORTED)
    backend = load_neuron_backend(serve_config(model_dir), model_dir)
    assert loaded == [str(model_dir)]
    assert backend.name == "neuron" and backend.device == "cpu"
    assert backend.policy.prefill_mode == "insert"
    assert (backend.policy.batch_size, backend.policy.max_length) == (4, SEQ_LEN)
    assert backend.pad_token_id == PAD  # config.json's pad_token_id (no tokenizer files)
    assert backend.capacity.max_sequences == 4
    # The engine refuses decoder_input_details (422) before queueing: no prompt logits here.
    assert backend.capacity.prompt_logprobs is False
    assert greedy(backend, PROMPTS[0], 6) == greedy_reference(llama, PROMPTS[0], 6)


def test_load_picks_rebuild_without_continuous_batching(
    tmp_path: Path,
    llama: PreTrainedModel,
    fake_optimum_neuron: Callable[[FakeNeuronConfig], list[str]],
) -> None:
    fake_optimum_neuron(FakeNeuronConfig(4, continuous_batching=False))
    model_dir = write_model_dir(tmp_path / "m", llama, EXPORTED)
    backend = load_neuron_backend(serve_config(model_dir), model_dir)
    assert backend.policy.prefill_mode == "rebuild"
    with pytest.raises(ConfigError, match="--prefill-mode insert"):
        load_neuron_backend(serve_config(model_dir, "insert"), model_dir)


def test_load_honours_requested_rebuild(
    tmp_path: Path,
    llama: PreTrainedModel,
    fake_optimum_neuron: Callable[[FakeNeuronConfig], list[str]],
) -> None:
    fake_optimum_neuron(FakeNeuronConfig(4))
    model_dir = write_model_dir(tmp_path / "m", llama, EXPORTED)
    backend = load_neuron_backend(serve_config(model_dir, "rebuild"), model_dir)
    assert backend.policy.prefill_mode == "rebuild"


def test_load_rejects_a_shape_mismatch(
    tmp_path: Path,
    llama: PreTrainedModel,
    fake_optimum_neuron: Callable[[FakeNeuronConfig], list[str]],
) -> None:
    fake_optimum_neuron(FakeNeuronConfig(2, 32))
    model_dir = write_model_dir(tmp_path / "m", llama, EXPORTED)
    with pytest.raises(ConfigError) as info:
        load_neuron_backend(serve_config(model_dir), model_dir)
    message = str(info.value)
    assert "batch_size=2 x sequence_length=32" in message
    assert f"batch_size=4 x sequence_length={SEQ_LEN}" in message


def test_unexported_model_is_compiled_at_start_up_with_the_config_shape(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    llama: PreTrainedModel,
    fake_optimum_neuron: Callable[[FakeNeuronConfig], list[str]],
) -> None:
    loaded = fake_optimum_neuron(FakeNeuronConfig(4))
    requests: list[neuron_export.ExportRequest] = []

    def fake_export(request: neuron_export.ExportRequest) -> NeuronExport:
        requests.append(request)
        write_model_dir(request.output, llama, EXPORTED)
        return NeuronExport(4, SEQ_LEN, 2, "fp32", "neuron_config.json")

    monkeypatch.setattr(neuron_export, "export", fake_export)
    model_dir = write_model_dir(tmp_path / "plain", llama, None)
    config = serve_config(model_dir)
    assert config.static_shape is not None
    output = tmp_path / "compiled"
    backend = load_neuron_backend(config, model_dir, export_dir=output)
    assert len(requests) == 1
    request = requests[0]
    shape = config.static_shape
    assert (request.model_dir, request.output) == (model_dir, output)
    assert (
        request.batch_size,
        request.sequence_length,
        request.num_cores,
        request.auto_cast_type,
    ) == (shape.batch_size, shape.sequence_length, shape.num_cores, shape.auto_cast_type)
    assert (request.batch_size, request.sequence_length, request.auto_cast_type) == (
        4,
        SEQ_LEN,
        "fp32",
    )
    assert loaded == [str(output)]
    assert greedy(backend, PROMPTS[1], 4) == greedy_reference(llama, PROMPTS[1], 4)
    # A second start-up finds the compiled model and does not compile again.
    load_neuron_backend(config, model_dir, export_dir=output)
    assert len(requests) == 1 and loaded == [str(output), str(output)]


def test_default_export_dir_depends_on_model_and_shape(tmp_path: Path) -> None:
    from tgis.config import StaticShape

    a = StaticShape(4, 64, 2, "bf16", "x")
    b = StaticShape(8, 64, 2, "bf16", "x")
    assert neuron.default_export_dir(tmp_path / "m", a) != neuron.default_export_dir(
        tmp_path / "m", b
    )
    assert neuron.default_export_dir(tmp_path / "m", a) != neuron.default_export_dir(
        tmp_path / "n" / "m", a
    )
    # --compile-cache DIR holds one directory per (model, shape) too.
    under = neuron.default_export_dir(tmp_path / "m", a, tmp_path / "cache")
    assert under.parent == tmp_path / "cache"
    assert under.name == neuron.default_export_dir(tmp_path / "m", a).name


def test_pad_token_falls_back_to_eos_then_zero(tmp_path: Path) -> None:
    config = types.SimpleNamespace(pad_token_id=None, eos_token_id=[2, 7])
    assert neuron.resolve_pad_token_id(tmp_path, config) == 2
    assert neuron.resolve_pad_token_id(tmp_path, types.SimpleNamespace()) == 0


def test_warmup_leaves_slots_free_and_runs_only_the_decode_graph(llama: PreTrainedModel) -> None:
    backend, fake = fake_backend(llama, 4, "insert", True)
    timings = backend.warmup(4, 24)
    assert [t.compiled for t in timings] == [0] * len(timings)
    assert backend.running == 0
    # Prefill shapes are all padding rows (skipped); the decode shape runs the whole batch.
    assert fake.calls == [("token_generation", 4, 1)]
    assert greedy(backend, PROMPTS[0], 4) == greedy_reference(llama, PROMPTS[0], 4)


def test_legacy_config_neuron_models_are_refused_with_the_fix(
    tmp_path: Path,
    llama: PreTrainedModel,
    fake_optimum_neuron: Callable[[FakeNeuronConfig], list[str]],
) -> None:
    """Hub models compiled by optimum-neuron < 0.1 carry a `neuron` section in config.json:
    the validation core reads their shape, but 0.4.5 cannot load them."""
    loaded = fake_optimum_neuron(FakeNeuronConfig(4))
    model_dir = write_model_dir(tmp_path / "legacy", llama, None)
    config = json.loads((model_dir / "config.json").read_text())
    config["neuron"] = {"batch_size": 4, "sequence_length": SEQ_LEN, "num_cores": 2,
                        "auto_cast_type": "fp32"}  # fmt: skip
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="older optimum-neuron") as info:
        load_neuron_backend(serve_config(model_dir), model_dir)
    assert "tgis export-neuron" in str(info.value)
    assert loaded == []
