"""Reasoning output: the markers read from a template or vocabulary, the streaming split into
reasoning and content however the text is cut, the grammar that lets a block come before the
answer (llguidance's own matcher as the oracle), and the special markers kept in the text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance as llg
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from tgis.engine.detokenize import TextStream
from tgis.params import GenerateParameters, GrammarSpec
from tgis.server.chat.reasoning import (
    FAMILIES,
    ReasoningMarkers,
    ReasoningParser,
    find_markers,
    grammar_after_reasoning,
    kept_ids,
    lark_literal,
    opened_in,
)

THINK = ReasoningMarkers("<think>", "</think>")


def split(text: str, step: int, opened: bool = False) -> tuple[str | None, str, list[Any]]:
    """Feed `text` in pieces of `step` characters: (reasoning, content, the parts sent)."""
    parser = ReasoningParser(THINK, opened)
    parts: list[Any] = []
    for i in range(0, len(text), step):
        parts += parser.feed(text[i : i + step])
    parts += parser.finish()
    return parser.reasoning, parser.content, parts


def joined(parts: list[Any], kind: str) -> str:
    return "".join(text for part, text in parts if part == kind)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_a_block_is_reasoning_and_the_rest_content_however_the_text_is_cut(step: int) -> None:
    text = "\n<think>\nParis is in France.\nSo: sunny? </thinking> no.\n</think>\n\nIt is sunny."
    reasoning, content, parts = split(text, step)
    assert reasoning == "Paris is in France.\nSo: sunny? </thinking> no."
    assert content == "It is sunny."
    # What was sent adds up to the same, reasoning first.
    assert joined(parts, "reasoning") == reasoning and joined(parts, "content") == content
    kinds = [part for part, _ in parts]
    assert kinds == sorted(kinds, key=lambda k: k == "content")


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_prompt_that_opened_the_block_starts_the_output_inside_it(step: int) -> None:
    reasoning, content, _ = split("Let me think. <think> stays.</think>Answer", step, True)
    assert reasoning == "Let me think. <think> stays."
    assert content == "Answer"


@pytest.mark.parametrize("step", [1, 1000])
def test_an_output_without_a_leading_block_is_untouched(step: int) -> None:
    text = " Hello <think>not reasoning</think> there\n"
    reasoning, content, _ = split(text, step)
    assert reasoning is None and content == text
    # A text that only starts like the marker is content too, once it cannot be it.
    assert split("<thin ice", step)[1] == "<thin ice"
    assert split("<th", step)[1] == "<th"  # the output ended before it could be told


def test_an_output_cut_off_inside_the_block_is_all_reasoning() -> None:
    reasoning, content, _ = split("<think>still going </thi", 2)
    assert reasoning == "still going </thi" and content == ""
    reasoning, content, _ = split("<think>", 1)
    assert reasoning == "" and content == ""


class Tok:
    """A tokenizer's chat template and vocabulary, as find_markers reads them."""

    def __init__(self, template: Any, vocab: tuple[str, ...] = ()) -> None:
        self.chat_template = template
        self._vocab = {t: i for i, t in enumerate(vocab)}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def test_the_markers_come_from_the_template_then_from_the_vocabulary() -> None:
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    assert find_markers(Tok(qwen3)) == THINK
    seed = "{{ '<seed:think>' }}...{{ '</seed:think>' }}"
    assert find_markers(Tok(seed)) == ReasoningMarkers("<seed:think>", "</seed:think>")
    magistral = Tok("{{ messages }}", ("a", "[THINK]", "[/THINK]"))
    assert find_markers(magistral) == ReasoningMarkers("[THINK]", "[/THINK]")
    # A template with other families' words but no markers, and no such tokens: none.
    assert find_markers(Tok("{{ messages }} think", ("think",))) is None
    assert find_markers(Tok(None)) is None
    assert FAMILIES[-1] == THINK
    assert find_markers(Tok({"default": "x", "tool_use": qwen3})) == THINK


def test_a_prompt_opened_the_block_when_its_last_marker_is_a_start() -> None:
    assert opened_in("<|assistant|>\n<think>\n", THINK)
    assert not opened_in("<|assistant|>\n<think>\n\n</think>\n\n", THINK)
    assert not opened_in("<|assistant|>", THINK)
    assert opened_in("<think>a</think> then <think>", THINK)


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path) -> tuple[Any, Any]:
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])


def accepts(tokenizers: tuple[Any, Any], spec: GrammarSpec, ids: list[int] | str) -> bool:
    """Whether the grammar lets a model write `ids` (or the text's ids) and then end."""
    tok, ll = tokenizers
    matcher = llg.LLMatcher(ll, spec.grammar(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    if isinstance(ids, str):
        ids = tok.encode(ids, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


ANSWER = GrammarSpec.json_schema(
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
)


def test_the_answer_grammar_holds_after_an_optional_block(demo: tuple[Any, Any]) -> None:
    tok = demo[0]
    optional = grammar_after_reasoning(ANSWER, THINK, opened=False, tokenizer=tok)
    assert optional.problem() is None and optional.source == ANSWER.source
    assert accepts(demo, optional, '{"a":1}')
    assert accepts(demo, optional, '<think>\nHm, {"a": "x"} maybe.\n</think>\n\n{"a":1}')
    assert not accepts(demo, optional, '<think>Hm</think>\n\n{"a":"x"}')  # the answer is held
    assert not accepts(demo, optional, 'Hm</think>{"a":1}')  # no block opened
    assert not accepts(demo, optional, '<think>Hm {"a":1}')  # the block never ended


def test_an_opened_block_must_end_before_the_answer(demo: tuple[Any, Any]) -> None:
    tok = demo[0]
    required = grammar_after_reasoning(ANSWER, THINK, opened=True, tokenizer=tok)
    assert accepts(demo, required, 'Hm.</think>{"a":2}')
    assert accepts(demo, required, '</think>\n{"a":2}')
    assert not accepts(demo, required, '{"a":2}')
    # Every kind of grammar nests: a regex and a Lark grammar too.
    regex = grammar_after_reasoning(GrammarSpec.regex("[0-9]+"), THINK, True, tok)
    assert accepts(demo, regex, "x</think>42") and not accepts(demo, regex, "x</think>4a")
    lark = grammar_after_reasoning(GrammarSpec.lark('start: "yes" | "no"'), THINK, True, tok)
    assert accepts(demo, lark, "ok</think> no") and not accepts(demo, lark, "ok</think>maybe")


def special_tokenizer(model_dir: Path) -> Any:
    """The demo tokenizer with the markers as special tokens, as some models have them."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tok


def test_special_markers_are_tokens_in_the_grammar_and_kept_in_the_text(
    demo_model_dir: Path,
) -> None:
    tok = special_tokenizer(demo_model_dir)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert lark_literal(tok, "</think>") == f"<[{end}]>"
    assert lark_literal(tok, "a b") == '"a b"'
    assert kept_ids(tok, ["</think>", "<think>", "plain"]) == (start, end)
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    spec = grammar_after_reasoning(GrammarSpec.regex("a+"), THINK, opened=True, tokenizer=tok)
    a = tok.encode("a", add_special_tokens=False)
    assert accepts((tok, ll), spec, [*a, end, *a])
    assert not accepts((tok, ll), spec, a + a)  # the text "</think>" is not the token
    # The detokenizer keeps the kept specials' text and skips the others (EOS here).
    ids = [start, *a, end, *a, tok.eos_token_id]
    for kept, expected in (((start, end), "<think>a</think>a"), ((), "aa")):
        params = GenerateParameters(kept_special_ids=kept, max_new_tokens=10)
        stream = TextStream(tok, params, [tok.eos_token_id])
        text = "".join(stream.push(i).text for i in ids)
        assert text == expected
        assert stream.final_text() == text


def test_the_grammar_json_nests_a_grammar_of_several_parts(demo: tuple[Any, Any]) -> None:
    """A body that llguidance writes as several named grammars keeps its references."""
    body = GrammarSpec.json_schema({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"})
    spec = grammar_after_reasoning(body, THINK, True, demo[0])
    names = [g.get("name") for g in json.loads(spec.value)["grammars"]]
    assert names[:2] == ["tgis_reasoning", "tgis_answer"]
    assert accepts(demo, spec, "x</think>12")
