"""Output constrained to a JSON schema or a regex: what comes out matches, on the paged and the
slot engines, greedy and sampled, alone and in batches with unconstrained neighbours (whose
tokens do not change); a grammar that cannot finish ends with `length`."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.engine.test_engine import PROMPTS, collect, request, run, tokenizer
from tests.engine.test_poison_batch import BACKENDS, make_engine
from tgis.engine.engine import Engine
from tgis.engine.types import FinishReason, GenerationRequest
from tgis.errors import InputValidationError
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
