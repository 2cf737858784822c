"""The encoder-decoder backend: greedy tokens equal transformers' generate for T5 (flan-T5's
gated layout and the original tied one) and BART, alone, in a batch of 8 inputs of different
lengths, and while sequences join and leave between steps."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import PreTrainedModel

from tests.factories import tiny_model
from tgis.backends.seq2seq.backend import Seq2SeqBackend
from tgis.engine.backend import PrefillItem
from tgis.errors import ConfigError

NEW_TOKENS = 10
# Wider initial weights than the defaults, so random models continue in varied tokens.
VARIANTS: dict[str, tuple[str, int, dict[str, object]]] = {
    "t5-gated": ("t5", 1, {"initializer_factor": 6.0}),
    "t5-tied-relu": (
        "t5",
        2,
        {"initializer_factor": 10.0, "feed_forward_proj": "relu", "tie_word_embeddings": True},
    ),
    "bart": ("bart", 1, {"init_std": 0.3, "tie_word_embeddings": False}),
    "bart-scaled": (
        "bart",
        1,
        {"init_std": 0.3, "tie_word_embeddings": False, "scale_embedding": True},
    ),
}
_built: dict[str, PreTrainedModel] = {}


def model_of(name: str) -> PreTrainedModel:
    if name == "mt5" and name not in _built:  # T5's layout under mT5's classes
        from transformers import AutoModelForSeq2SeqLM, MT5Config

        torch.manual_seed(1)
        fields = tiny_model("t5").config.to_dict()
        fields.update(initializer_factor=6.0, model_type="mt5")
        _built[name] = AutoModelForSeq2SeqLM.from_config(MT5Config(**fields)).eval()
    if name not in _built:
        arch, seed, overrides = VARIANTS[name]
        _built[name] = tiny_model(arch, seed=seed, **overrides)  # type: ignore[arg-type]
    return _built[name]


def inputs(count: int) -> list[tuple[int, ...]]:
    rng = random.Random(7)
    return [tuple(rng.randrange(4, 128) for _ in range(rng.randrange(1, 30))) for _ in range(count)]


def reference(model: PreTrainedModel, ids: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            forced_eos_token_id=None,
            forced_bos_token_id=None,
        )
    return out[0, 1:].tolist()  # after the decoder start token


def backend(model: PreTrainedModel, slots: int = 8) -> Seq2SeqBackend:
    return Seq2SeqBackend(copy.deepcopy(model), max_sequences=slots, max_sequence_tokens=64)


def greedy(b: Seq2SeqBackend, prompts: list[tuple[int, ...]], join_every: int) -> list[list[int]]:
    """Greedy tokens of each prompt; a new one joins every `join_every` steps, and each leaves
    (releasing its slot) once it has NEW_TOKENS."""
    tokens: dict[int, list[int]] = {}
    waiting = list(range(len(prompts)))
    step = 0
    while waiting or any(len(t) < NEW_TOKENS for t in tokens.values()):
        if waiting and step % join_every == 0:
            index = waiting.pop(0)
            logits = b.prefill([PrefillItem(index, prompts[index])]).last
            tokens[index] = [int(logits[0].argmax())]
        running = [i for i, t in tokens.items() if len(t) < NEW_TOKENS]
        if running:
            logits = b.decode(running, [tokens[i][-1] for i in running])
            for row, i in enumerate(running):
                tokens[i].append(int(logits[row].argmax()))
                if len(tokens[i]) == NEW_TOKENS:
                    b.release(i)
        step += 1
    return [tokens[i] for i in range(len(prompts))]


@pytest.mark.parametrize("name", [*sorted(VARIANTS), "mt5"])
def test_greedy_equals_generate_alone_and_in_a_batch_of_8(name: str) -> None:
    model = model_of(name)
    prompts = inputs(8)
    expected = [reference(model, p) for p in prompts]
    # Not vacuous: the inputs lead to different outputs, of several tokens.
    assert len({tuple(tokens) for tokens in expected}) >= 4
    assert len({t for tokens in expected for t in tokens}) >= 4
    b = backend(model)
    alone = [greedy(b, [p], join_every=1)[0] for p in prompts]
    assert alone == expected
    together = b.prefill([PrefillItem(i, p) for i, p in enumerate(prompts)]).last
    batch = [[int(row.argmax())] for row in together]
    for _ in range(NEW_TOKENS - 1):
        logits = b.decode(list(range(8)), [t[-1] for t in batch])
        for row, tokens in enumerate(batch):
            tokens.append(int(logits[row].argmax()))
    assert batch == expected


@pytest.mark.parametrize("name", ["t5-gated", "bart"])
def test_sequences_join_and_leave_between_steps(name: str) -> None:
    model = model_of(name)
    prompts = inputs(6)
    expected = [reference(model, p) for p in prompts]
    b = backend(model, slots=3)  # fewer slots than prompts: slots are reused
    assert greedy(b, prompts, join_every=3) == expected
    assert b._free == [0, 1, 2] and not b._slot_of


def test_capacity_says_what_the_backend_can_do() -> None:
    b = backend(model_of("t5-gated"), slots=4)
    cap = b.capacity
    assert cap.encoder_decoder and cap.prompt_prefixes and not cap.prompt_logprobs
    assert (cap.max_sequences, cap.max_sequence_tokens) == (4, 64)


def test_bad_steps_are_refused_before_touching_the_cache() -> None:
    b = backend(model_of("bart"), slots=2)
    with pytest.raises(ValueError, match="not running"):
        b.decode([5], [7])
    with pytest.raises(ValueError):
        b.prefill([PrefillItem(i, (5, 6)) for i in range(3)])  # more than the free slots
    with pytest.raises(ValueError):
        b.prefill([PrefillItem(0, tuple(range(4, 70)))])  # longer than max_sequence_tokens
    assert b._free == [0, 1] and not b._slot_of


def test_warmup_leaves_no_sequence_behind() -> None:
    b = backend(model_of("t5-gated"), slots=4)
    timings = b.warmup(max_batch_size=4, max_input_tokens=32)
    assert [t.shape.label() for t in timings] == ["prefill 1x32", "decode 4"]
    assert b._free == [0, 1, 2, 3] and not b._slot_of


def prefix_rows(model: PreTrainedModel, rows: int, seed: int) -> torch.Tensor | None:
    if rows == 0:
        return None
    scale = model.get_input_embeddings().weight.std().item()
    return (
        torch.randn(rows, model.config.d_model, generator=torch.Generator().manual_seed(seed))
        * scale
    )


def prefixed_reference(
    model: PreTrainedModel,
    ids: tuple[int, ...],
    encoder: torch.Tensor | None,
    decoder: torch.Tensor | None,
) -> list[int]:
    """Greedy tokens of the model's own forward over [encoder prefix; input embeddings] and
    [decoder prefix; start token; generated tokens] (recomputed whole at each step)."""
    with torch.no_grad():
        embed = model.get_encoder().embed_tokens
        source = embed(torch.tensor([ids]))
        if encoder is not None:
            source = torch.cat([encoder[None], source], dim=1)
        encoded = model.get_encoder()(inputs_embeds=source).last_hidden_state
        tokens = [model.config.decoder_start_token_id]
        out: list[int] = []
        for _ in range(NEW_TOKENS):
            target = model.get_decoder().embed_tokens(torch.tensor([tokens]))
            if decoder is not None:
                target = torch.cat([decoder[None], target], dim=1)
            logits = model(encoder_outputs=(encoded,), decoder_inputs_embeds=target).logits
            out.append(int(logits[0, -1].argmax()))
            tokens.append(out[-1])
    return out


@pytest.mark.parametrize("name", ["t5-gated", "bart"])
def test_prompt_prefixes_go_before_the_encoders_and_the_decoders_inputs(name: str) -> None:
    model = model_of(name)
    prompts = inputs(4)
    shapes = [(3, 2), (0, 4), (5, 0), (0, 0)]  # encoder rows, decoder rows; the last: none
    prefixes = [
        (prefix_rows(model, e, 10 + i), prefix_rows(model, d, 20 + i))
        for i, (e, d) in enumerate(shapes)
    ]
    expected = [
        prefixed_reference(model, p, enc, dec)
        for p, (enc, dec) in zip(prompts, prefixes, strict=True)
    ]
    plain = [reference(model, p) for p in prompts]
    assert sum(expected[i] != plain[i] for i in range(3)) >= 2 and expected[3] == plain[3]
    b = backend(model)
    items = [
        PrefillItem(i, p, embeds=dec, encoder_embeds=enc)
        for i, (p, (enc, dec)) in enumerate(zip(prompts, prefixes, strict=True))
    ]
    batch = [[int(row.argmax())] for row in b.prefill(items).last]
    for _ in range(NEW_TOKENS - 1):
        logits = b.decode(list(range(4)), [t[-1] for t in batch])
        for row, tokens in enumerate(batch):
            tokens.append(int(logits[row].argmax()))
    assert batch == expected


def test_other_encoder_decoder_types_are_refused_with_the_list() -> None:
    from transformers import AutoModelForSeq2SeqLM, MarianConfig

    model = AutoModelForSeq2SeqLM.from_config(
        MarianConfig(vocab_size=64, pad_token_id=3, decoder_start_token_id=3, d_model=16,
                     encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=2, decoder_attention_heads=2,
                     encoder_ffn_dim=32, decoder_ffn_dim=32)
    )  # fmt: skip
    with pytest.raises(ConfigError) as info:
        Seq2SeqBackend(model, max_sequences=2, max_sequence_tokens=16)
    assert "'marian' is not served" in str(info.value) and "t5, mt5, bart" in str(info.value)
