"""Model-native tool-call formats: which family a template writes, the grammar of each family
and tool_choice (llguidance's matcher as the oracle), and the scanner reading each family's
calls back however the text is cut."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance as llg
import llguidance.hf
import pytest
from openai.lib.streaming._deltas import accumulate_delta
from transformers import AutoTokenizer

from tgis.server.chat.prompt import ChatFormat
from tgis.server.chat.tool_calls import COMPACT, Tool, ToolCallScanner, ToolChoice, ToolFormat
from tgis.server.chat.tool_formats import (
    GRANITE,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    find_tool_format,
    tool_grammar,
)

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
NONE = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = (Tool("get_weather", None, CITY), Tool("now", None, NONE))
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
N = '{"name": "now", "arguments": {}}'
L = W.replace("arguments", "parameters")


class Tok:
    def __init__(self, template: str) -> None:
        self.chat_template = template


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ tools }}<tool_call>\n{{ c | tojson }}\n</tool_call>", HERMES),
        ("{{ tools }}[TOOL_CALLS] [{{ calls }}]", MISTRAL),
        ("{{ tools }}<|tool_call|>{{ calls }}", GRANITE),
        ("{{ tools }}<|python_tag|>{{ c }}", LLAMA3_JSON),
        (
            '{{ tools }}Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}",
            LLAMA3_JSON,
        ),
        ("{{ tools }}{{ messages }}", COMPACT),
    ],
)
def test_the_template_names_the_family(template: str, expected: ToolFormat) -> None:
    assert find_tool_format(Tok(template)) == expected
    assert ChatFormat.of(Tok(template)).tools == expected
    # A template that does not render tools keeps the compact format and the instruction.
    assert ChatFormat.of(Tok(template.replace("{{ tools }}", ""))).tools == COMPACT


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path) -> tuple[Any, Any]:
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])


def allows(demo: tuple[Any, Any], mode: str, fmt: ToolFormat, text: str, **kw: Any) -> bool:
    tok, ll = demo
    spec = tool_grammar(ToolChoice(TOOLS, mode, **kw), fmt, tok)  # type: ignore[arg-type]
    assert spec.problem() is None and spec.source == "tools"
    matcher = llg.LLMatcher(ll, spec.grammar(), log_level=0)
    ids = tok.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_hermes_calls_each_in_their_tags(demo: tuple[Any, Any]) -> None:
    one, two = f"<tool_call>\n{W}\n</tool_call>", f"<tool_call>\n{N}\n</tool_call>"
    assert allows(demo, "required", HERMES, one)
    assert allows(demo, "required", HERMES, f"{one}\n{two}")
    assert not allows(demo, "required", HERMES, f"{one}\n{two}", parallel=False)
    assert not allows(demo, "required", HERMES, "Sunny.")
    assert not allows(demo, "required", HERMES, one.replace('": "', '":"'))  # spaced JSON
    assert allows(demo, "auto", HERMES, "Sunny.")
    assert allows(demo, "auto", HERMES, f"Let me check.\n{one}")
    assert allows(demo, "named", HERMES, two, name="now")
    assert not allows(demo, "named", HERMES, one, name="now")


def test_llama_calls_are_objects_with_parameters(demo: tuple[Any, Any]) -> None:
    assert allows(demo, "required", LLAMA3_JSON, L)
    assert allows(demo, "required", LLAMA3_JSON, f"<|python_tag|>{L}; {L}")
    assert not allows(demo, "required", LLAMA3_JSON, W)  # `arguments` is not Llama's key
    assert allows(demo, "auto", LLAMA3_JSON, "It is sunny.")
    assert not allows(demo, "auto", LLAMA3_JSON, '{"not": "a call"}')


def test_mistral_and_granite_calls_are_one_array_after_the_marker(
    demo: tuple[Any, Any],
) -> None:
    assert allows(demo, "required", MISTRAL, f"[TOOL_CALLS] [{W}, {N}]")
    assert allows(demo, "required", MISTRAL, f"[TOOL_CALLS][{W}]")
    assert not allows(demo, "required", MISTRAL, f"[TOOL_CALLS] [{W}, {N}]", parallel=False)
    assert allows(demo, "auto", MISTRAL, f"Checking. [TOOL_CALLS][{W}]")
    assert allows(demo, "required", GRANITE, f"<|tool_call|>[{W}]")
    assert not allows(demo, "required", GRANITE, f"[{W}]")


def scan(fmt: ToolFormat, text: str, step: int) -> tuple[ToolCallScanner, dict[str, Any]]:
    """Feed `text` in pieces of `step` characters; the deltas accumulated as the openai client
    does it."""
    scanner = ToolCallScanner(fmt)
    message: dict[Any, Any] = {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for delta in [d for p in pieces for d in scanner.feed(p)] + scanner.finish():
        message = accumulate_delta(message, delta)  # type: ignore[arg-type]
    return scanner, message


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(
    ("fmt", "text", "content"),
    [
        (
            HERMES,
            f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{N}\n</tool_call>",
            "Let me check.",
        ),
        (LLAMA3_JSON, f"<|python_tag|>{L}; {N.replace('arguments', 'parameters')}", None),
        (LLAMA3_JSON, f" {L}; {N.replace('arguments', 'parameters')}", None),
        (MISTRAL, f"[TOOL_CALLS] [{W}, {N}]", None),
        (GRANITE, f"<|tool_call|>[{W}, {N}]", None),
        (COMPACT, f"[{W.replace(': ', ':').replace(', ', ',')},{N.replace(': ', ':')}]", None),
    ],
)
def test_each_family_is_read_back_as_calls(
    fmt: ToolFormat, text: str, content: str | None, step: int
) -> None:
    scanner, streamed = scan(fmt, text, step)
    message = scanner.message()
    assert message["content"] == content
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert streamed["tool_calls"] == [{"index": i, **c} for i, c in enumerate(calls)]
    assert scanner.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("step", [1, 1000])
def test_text_that_only_starts_like_a_marker_is_content(step: int) -> None:
    scanner, streamed = scan(HERMES, "Use <tool> or <tool_c", step)
    assert not scanner.called
    assert scanner.message() == {"content": "Use <tool> or <tool_c"}
    assert streamed == {"content": "Use <tool> or <tool_c"}
    assert scanner.finish_reason("stop") == "stop"
    llama, _ = scan(LLAMA3_JSON, "Sunny {really}", step)
    assert llama.message() == {"content": "Sunny {really}"}


def test_special_markers_are_tokens_in_the_grammar_and_kept(demo_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.chat_template = "{{ tools }}[TOOL_CALLS]"
    (marker,) = tok.convert_tokens_to_ids(["[TOOL_CALLS]"])
    fmt = ChatFormat.of(tok)
    assert fmt.tools == MISTRAL and fmt.kept_special_ids == (marker,)
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    spec = tool_grammar(ToolChoice(TOOLS, "required"), MISTRAL, tok)
    assert f"<[{marker}]>" in spec.value
    spelled = [
        i for text in ("[TOOL", "_CALLS]") for i in tok.encode(text, add_special_tokens=False)
    ]
    assert marker not in spelled
    for ids, expected in (([marker], True), (spelled, False)):
        matcher = llg.LLMatcher(ll, spec.grammar(), log_level=0)
        ok = all(matcher.consume_token(t) for t in ids)
        tail = tok.encode(f"[{W}]", add_special_tokens=False)
        assert (ok and all(matcher.consume_token(t) for t in tail)) == expected
