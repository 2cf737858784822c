"""A reasoning block held to a budget (`ThinkingLimit`): the marker forced once the budget is
spent, only the first block counted, the grammar around it obeyed; and on the demo model's
engines (paged and slot), the output before the forced marker equal to the unbudgeted one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_engine import PROMPTS, request, tokenizer
from tests.engine.test_grammar import texts
from tests.engine.test_poison_batch import BACKENDS, make_engine
from tgis.engine.engine import Engine
from tgis.engine.grammar import GrammarCompiler
from tgis.engine.thinking import ThinkingLimit
from tgis.engine.types import FinishReason
from tgis.params import GrammarSpec, ThinkingBudget

__all__ = ["tokenizer"]

START, END = (4,), (7, 8)


def limit(tokens: int, opened: bool = True) -> ThinkingLimit:
    return ThinkingLimit(ThinkingBudget(tokens, START, END, opened))


def walk(limit_: ThinkingLimit, ids: list[int]) -> list[int | None]:
    """The forced token before each id, then after the last."""
    forced = []
    for token in ids:
        forced.append(limit_.forced())
        limit_.advance(token)
    return [*forced, limit_.forced()]


def test_the_end_marker_is_forced_once_the_budget_is_spent() -> None:
    assert walk(limit(3), [1, 2, 3, 7, 8, 9]) == [None, None, None, 7, 8, None, None]


def test_a_marker_the_model_began_is_finished_not_restarted() -> None:
    # Two thought tokens, then the model writes the marker's first token at the limit.
    assert walk(limit(3), [1, 2, 7, 8]) == [None, None, None, 8, None]


def test_a_block_closed_within_the_budget_forces_nothing_after() -> None:
    assert walk(limit(3), [1, 7, 8, 1, 2, 3, 4, 1, 2, 3]) == [None] * 11


def test_an_unopened_block_starts_at_the_start_marker() -> None:
    assert walk(limit(2, opened=False), [9, 9, 9, 4, 1, 2, 7, 8]) == [
        None, None, None, None, None, None, 7, 8, None
    ]  # fmt: skip
    # No block at all: nothing is ever forced.
    assert set(walk(limit(1, opened=False), [9] * 8)) == {None}


@pytest.mark.parametrize("token", [0, 31, 32, 63, 100])
def test_a_forced_token_is_the_only_bit_of_the_mask(token: int) -> None:
    forced = ThinkingLimit(ThinkingBudget(1, (), (token,), opened=True))
    assert bool(forced.allowed(128).all())  # nothing spent yet: all allowed
    forced.advance(5)
    allowed = forced.allowed(128)
    assert allowed.nonzero().flatten().tolist() == [token]


def test_copies_and_lookahead_leave_the_limit_where_it_was() -> None:
    original = limit(2)
    original.advance(1)
    twin = original.copy()
    twin.advance(2)
    assert original.forced() is None and twin.forced() == 7
    masks = original.masks_ahead([2, 7, 8, 5], 64)
    assert original.forced() is None and original.spent == 1
    assert masks[0] is not None and masks[0].allowed(64).nonzero().flatten().tolist() == [7]
    assert masks[1] is not None and masks[1].allowed(64).nonzero().flatten().tolist() == [8]
    assert masks[2] is not None and bool(masks[2].allowed(64).all())
    # A draft that leaves the forced marker is rejected there, and nothing after it is used.
    assert original.masks_ahead([2, 5, 7], 64)[1:] == [None, None]


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def engine(request: Any, demo_model_dir: Path, tokenizer: Any) -> Iterator[Engine]:
    eng = make_engine(BACKENDS[request.param](demo_model_dir), demo_model_dir, tokenizer)
    yield eng
    eng.stop()


def ids_of(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def test_the_engine_closes_an_opened_block_at_the_budget(engine: Engine, tokenizer: Any) -> None:
    budget = ThinkingBudget(5, ids_of(tokenizer, "<think>"), ids_of(tokenizer, "</think>"), True)
    free, held = texts(engine, [
        request(tokenizer, PROMPTS[0], "free", max_new_tokens=30, ignore_eos=True),
        request(tokenizer, PROMPTS[0], "held", max_new_tokens=30, ignore_eos=True,
                thinking_budget=budget),
    ])  # fmt: skip
    before = tokenizer.decode(tokenizer.encode(free[0], add_special_tokens=False)[:5])
    assert "</think>" not in before
    assert held[0].startswith(before + "</think>"), (free, held)


def test_a_grammar_opens_the_block_and_the_budget_closes_it(engine: Engine, tokenizer: Any) -> None:
    grammar = GrammarSpec.lark(
        'start: "<think>" thought "yes"\nthought[lazy]: THOUGHT "</think>"\nTHOUGHT: /(.|\\n)*/\n'
    )
    budget = ThinkingBudget(3, ids_of(tokenizer, "<think>"), ids_of(tokenizer, "</think>"))
    (text, reason), = texts(engine, [
        request(tokenizer, PROMPTS[1], "g", max_new_tokens=40, grammar=grammar,
                thinking_budget=budget),
    ])  # fmt: skip
    assert reason is FinishReason.EOS_TOKEN
    assert text.startswith("<think>") and text.endswith("</think>yes"), text
    thought = text.removeprefix("<think>").removesuffix("</think>yes")
    assert len(tokenizer.encode(thought, add_special_tokens=False)) <= 3, text


def test_a_grammar_that_refuses_the_marker_outranks_the_budget(tokenizer: Any) -> None:
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id])
    inner = compiler.constraint(GrammarSpec.regex("[a-z]{0,20}"))
    end = ids_of(tokenizer, "</think>")
    held = ThinkingLimit(ThinkingBudget(1, (), end, opened=True), inner)
    held.advance(ids_of(tokenizer, "a")[0])
    assert held.forced() == end[0]
    width = len(tokenizer)
    assert held.allowed(width).tolist() == inner.allowed(width).tolist()
