"""Output constrained to a JSON schema or a regex: what comes out matches, on the paged and the
slot engines, greedy and sampled, alone and in batches with unconstrained neighbours (whose
tokens do not change); a grammar that cannot finish ends with `length`."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.engine.test_engine import PROMPTS, collect, request, run, tokenizer
from tests.engine.test_poison_batch import BACKENDS, make_engine
from tests.factories import tiny_tokenizer
from tgis.engine import engine as engine_module
from tgis.engine import grammar
from tgis.engine.engine import Engine
from tgis.engine.types import FinishReason, GenerationRequest
from tgis.errors import GenerationError, InputValidationError
from tgis.params import GrammarSpec, RequestLimits, validate

__all__ = ["tokenizer"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CODE = r"[0-9]{3}-[a-z]{2,5}"


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def engine(request: Any, demo_model_dir: Path, tokenizer: Any) -> Iterator[Engine]:
    eng = make_engine(BACKENDS[request.param](demo_model_dir), demo_model_dir, tokenizer)
    yield eng
    eng.stop()


def texts(engine: Engine, reqs: list[GenerationRequest]) -> list[tuple[str, FinishReason]]:
    async def one(r: GenerationRequest) -> tuple[str, FinishReason]:
        events = await collect(engine.generate(r))
        completion = events[-1].completion
        assert completion is not None
        return completion.generated_text, completion.finish_reason

    async def together() -> list[tuple[str, FinishReason]]:
        return list(await asyncio.gather(*(one(r) for r in reqs)))

    return run(together())


def constrained(tokenizer: Any, prompt: str, spec: GrammarSpec, **params: Any) -> GenerationRequest:
    return request(tokenizer, prompt, "g", max_new_tokens=40, grammar=spec, **params)


def test_json_schema_output_is_valid_json(engine: Engine, tokenizer: Any) -> None:
    reqs = [
        constrained(tokenizer, PROMPTS[0], GrammarSpec.json_schema(PERSON)),
        constrained(tokenizer, PROMPTS[1], GrammarSpec.json_schema(PERSON), do_sample=True,
                    temperature=1.5, seed=3),
    ]  # fmt: skip
    for text, reason in texts(engine, reqs):
        assert reason is FinishReason.EOS_TOKEN, text
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_output_matches(engine: Engine, tokenizer: Any) -> None:
    reqs = [
        constrained(tokenizer, p, GrammarSpec.regex(CODE), do_sample=True, seed=s)
        for s, p in enumerate(PROMPTS[:3])
    ]
    for text, reason in texts(engine, reqs):
        assert reason is FinishReason.EOS_TOKEN
        assert re.fullmatch(CODE, text), text


def test_unconstrained_neighbours_are_unchanged(engine: Engine, tokenizer: Any) -> None:
    plain = [request(tokenizer, p, f"p{i}", max_new_tokens=8, ignore_eos=True)
             for i, p in enumerate(PROMPTS[:3])]  # fmt: skip
    alone = texts(engine, plain)
    mixed = texts(engine, [plain[0], constrained(tokenizer, PROMPTS[0], GrammarSpec.regex(CODE)),
                           plain[1], constrained(tokenizer, PROMPTS[2], GrammarSpec.json_schema(PERSON)),
                           plain[2]])  # fmt: skip
    assert [mixed[0], mixed[2], mixed[4]] == alone
    assert re.fullmatch(CODE, mixed[1][0])
    jsonschema.validate(json.loads(mixed[3][0]), PERSON)


def test_a_grammar_that_cannot_finish_ends_with_length(engine: Engine, tokenizer: Any) -> None:
    spec = GrammarSpec.regex("[a-z]{50}")
    (text, reason), = texts(engine, [request(tokenizer, PROMPTS[0], "g", max_new_tokens=5,
                                             grammar=spec)])  # fmt: skip
    assert reason is FinishReason.LENGTH
    assert re.fullmatch("[a-z]*", text)


LIMITS = RequestLimits(
    max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=100,
    max_total_tokens=128,
)  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "extra", "message"),
    [
        (GrammarSpec.json_schema({"type": "strng"}), {}, "not a usable JSON schema: Invalid type"),
        (GrammarSpec.regex("[0-9]{3"), {}, "unclosed counted repetition"),
        (GrammarSpec.regex("a"), {"min_new_tokens": 2}, "cannot be combined"),
        (GrammarSpec.regex("a"), {"ignore_eos": True}, "cannot be combined"),
    ],
)
def test_unusable_grammars_are_refused(
    spec: GrammarSpec, extra: dict[str, Any], message: str
) -> None:
    from tgis.params import GenerateParameters

    with pytest.raises(InputValidationError, match=message):
        validate(GenerateParameters(grammar=spec, max_new_tokens=4, **extra), 3, LIMITS)


@pytest.mark.parametrize("width", [4096, 4100, 4128, 1000])
def test_masks_are_packed_bitmasks_of_the_models_width(tokenizer: Any, width: int) -> None:
    """A step uploads each constrained row's mask as int32 words (1/8 of a bool mask): they
    unpack to what the grammar allows, ids past the tokenizer's vocabulary (a model's padded
    vocabulary) never allowed; a mask computed ahead packs the same."""
    import torch

    from tgis.engine.grammar import GrammarCompiler, unpack

    compiler = GrammarCompiler(tokenizer, [0])
    constraint = compiler.constraint(GrammarSpec.regex("(def|class) [a-z]+"))
    packed = constraint.packed(width)
    assert packed.dtype == torch.int32 and packed.shape == ((width + 31) // 32,)
    allowed = unpack(packed, width)
    assert allowed.shape == (width,)
    vocab = len(tokenizer)
    assert not allowed[vocab:].any()  # padding ids
    ids = {int(i) for i in allowed.nonzero()}
    texts = {tokenizer.decode([i]) for i in ids}
    assert ids and all(("def".startswith(t) or "class".startswith(t)) for t in texts if t)
    assert torch.equal(constraint.allowed(width), allowed)
    (ahead,) = constraint.masks_ahead([tokenizer.encode("def")[0]], width)
    assert ahead is not None and torch.equal(
        unpack(ahead.packed(width), width), ahead.allowed(width)
    )


def blocked_builds(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], threading.Event]:
    """The grammar tokenizer's builds held until the event is set; the threads they ran on."""
    builds: list[str] = []
    release = threading.Event()
    build = grammar.llguidance_tokenizer

    def held(tokenizer: Any, eos_token_ids: Any) -> Any:
        builds.append(threading.current_thread().name)
        release.wait(10)
        return build(tokenizer, eos_token_ids)

    monkeypatch.setattr(grammar, "llguidance_tokenizer", held)
    return builds, release


def test_a_grammar_request_during_the_tokenizers_build_waits_for_it(
    demo_model_dir: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prepare` starts the build in a thread of its own and returns; the engine serves
    meanwhile, a grammar request waits for the build and then succeeds, and every grammar
    after it uses the same build."""
    builds, release = blocked_builds(monkeypatch)
    eng = make_engine(BACKENDS["paged"](demo_model_dir), demo_model_dir, tokenizer)
    try:
        eng.grammars.prepare()
        eng.grammars.prepare()
        assert not eng.grammars.ready

        async def during_the_build() -> tuple[list[Any], list[Any]]:
            waiting = asyncio.ensure_future(
                collect(eng.generate(constrained(tokenizer, PROMPTS[0], GrammarSpec.regex(CODE))))
            )
            plain = await collect(eng.generate(request(tokenizer, PROMPTS[1], "p")))
            assert not waiting.done() and not eng.grammars.ready
            release.set()
            return plain, await waiting

        plain, events = run(during_the_build())
        assert plain[-1].completion is not None
        completion = events[-1].completion
        assert completion is not None and completion.finish_reason is FinishReason.EOS_TOKEN
        assert re.fullmatch(CODE, completion.generated_text)
        spec = GrammarSpec.json_schema(PERSON)
        (text, _), _ = texts(eng, [constrained(tokenizer, PROMPTS[2], spec)] * 2)
        jsonschema.validate(json.loads(text), PERSON)
        assert builds == ["tgis-grammar-tokenizer"]
        assert eng.grammars.build_s is not None and eng.grammars.error is None
    finally:
        release.set()
        eng.stop()


def test_a_build_that_outlasts_the_wait_fails_the_request_not_the_server(
    demo_model_dir: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, release = blocked_builds(monkeypatch)
    monkeypatch.setattr(engine_module, "BUILD_WAIT_S", 0.2)
    eng = make_engine(BACKENDS["paged"](demo_model_dir), demo_model_dir, tokenizer)
    try:
        spec = GrammarSpec.regex(CODE)
        with pytest.raises(GenerationError, match="its tokenizer is still being built"):
            run(collect(eng.generate(constrained(tokenizer, PROMPTS[0], spec))))
        release.set()
        assert eng.grammars.wait(30)
        ((text, _),) = texts(eng, [constrained(tokenizer, PROMPTS[0], spec)])
        assert re.fullmatch(CODE, text)
    finally:
        release.set()
        eng.stop()


def test_a_tokenizer_llguidance_cannot_take_fails_grammars_with_a_422_naming_why(
    demo_model_dir: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(tokenizer: Any, eos_token_ids: Any) -> Any:
        raise ValueError("Only fast tokenizers are supported")

    monkeypatch.setattr(grammar, "llguidance_tokenizer", refused)
    eng = make_engine(BACKENDS["paged"](demo_model_dir), demo_model_dir, tokenizer)
    try:
        eng.grammars.prepare()
        message = "unavailable with this model's tokenizer: Only fast tokenizers are supported"
        for _ in range(2):
            with pytest.raises(InputValidationError, match=message):
                spec = GrammarSpec.regex(CODE)
                run(collect(eng.generate(constrained(tokenizer, PROMPTS[0], spec))))
        plain = run(collect(eng.generate(request(tokenizer, PROMPTS[1], "p"))))
        assert plain[-1].completion is not None  # the rest is served
    finally:
        eng.stop()


def ll_masks(ll: Any, spec: GrammarSpec, steps: int = 4) -> list[list[int]]:
    """The ids a grammar allows at each of its first `steps` steps, taking the middle one."""
    import llguidance as llg
    import torch

    matcher = llg.LLMatcher(ll, spec.grammar(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    words = (ll.vocab_size + 31) // 32
    masks = []
    for _ in range(steps):
        bitmask = torch.zeros(words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        allowed = [int(i) for i in grammar.unpack(bitmask, ll.vocab_size).nonzero()]
        masks.append(allowed)
        if not allowed or matcher.is_stopped():
            break
        assert matcher.consume_token(allowed[len(allowed) // 2])
    return masks


def test_plain_added_tokens_go_to_llguidance_as_its_own_reading_of_them(tokenizer: Any) -> None:
    """A byte-level tokenizer's added tokens that are not special move into its vocabulary (a
    linear build: llguidance's own reading of added tokens takes quadratic time), and
    llguidance sees the same tokenizer as `llguidance.hf.from_tokenizer` makes: every id's
    bytes and special flag, and the masks of grammars that name the added tokens."""
    import llguidance.hf

    tok = copy.deepcopy(tokenizer)
    # llguidance takes the texts in angle brackets for special tokens, the others for text.
    plain = ["<|unused_0|>", "<|unused_1|>", "< a>", "<>", " spaced out", "ünïcode ✓", "\t\t",
             "[TOOL]", "<|a|>b", "a<|b|>"]  # fmt: skip
    tok.add_tokens(plain)
    tok.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    ours = grammar.llguidance_tokenizer(tok, [0])
    theirs = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[0])
    # Padding and truncation are left out, the tokenizer's own left as they are.
    padded = copy.deepcopy(tok)
    padded.backend_tokenizer.enable_padding(length=64)
    padded.backend_tokenizer.enable_truncation(16)
    from_padded = grammar.llguidance_tokenizer(padded, [0])
    assert padded.backend_tokenizer.truncation is not None
    assert padded.backend_tokenizer.padding is not None
    moved = json.loads(grammar.added_tokens_in_vocabulary(tok.backend_tokenizer.to_str()))
    left = [token["content"] for token in moved["added_tokens"]]
    assert left == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
    assert ours.vocab_size == theirs.vocab_size == len(tok)
    for i in range(len(tok)):
        assert ours.decode_bytes([i]) == theirs.decode_bytes([i]), i
        assert ours.is_special_token(i) == theirs.is_special_token(i), i
    long_text = " ".join(PROMPTS)
    assert from_padded.tokenize_str(long_text) == theirs.tokenize_str(long_text)
    specs = [
        GrammarSpec.regex(r"(<\|unused_[01]\|>|< a>| spaced out|ünïcode ✓|\t|\[TOOL\])+ [a-z]+"),
        GrammarSpec.lark('start: <tool> "x" | "<|unused_1|>" | <|im_end|>\n'),
        GrammarSpec.json_schema(PERSON),
    ]
    for spec in specs:
        assert ll_masks(ours, spec) == ll_masks(theirs, spec)
    ids = dict(zip(plain, tok.convert_tokens_to_ids(plain), strict=True))
    (first,) = ll_masks(ours, specs[0], steps=1)
    assert {ids[" spaced out"], ids["[TOOL]"]} <= set(first) and ids["<|unused_0|>"] not in first
    # Any other tokenizer's JSON goes as it is.
    sentencepiece = tiny_tokenizer()
    sentencepiece.add_tokens(["<|unused_0|>"])
    serialized = sentencepiece.backend_tokenizer.to_str()
    assert grammar.added_tokens_in_vocabulary(serialized) is serialized
