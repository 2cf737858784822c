"""Model-native tool calls: the format a model was trained to call tools in, read from its chat
template, held by a grammar and parsed back into OpenAI's `tool_calls`.

| family | a call as the model writes it |
|---|---|
| Hermes, Qwen 2.5/3 | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one per call |
| Llama 3.1+ (JSON) | `{"name": "f", "parameters": {...}}`, calls joined by `; `, `<|python_tag|>` optional |
| Mistral | `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` |
| Granite 3 | `<|tool_call|>[{"name": "f", "arguments": {...}}, ...]` |

A template is of a family when its source writes the family's marker (the first row that
matches, in this order). Such a template renders the tool definitions and describes the format
itself, so tgis adds no instruction. A template of no family keeps tgis's compact JSON array
(tgis.server.chat.tool_calls). The JSON inside is spaced as the templates write it (`tojson`).

The grammar follows `tool_choice`: `required` and a named function allow only calls (one with
`parallel_tool_calls: false` or a named function); `auto` allows text, or text and then calls
for a family whose calls open with a marker (Hermes, Mistral, Granite), or text that does not
open with `{` for Llama. A marker that is one special token is written as that token, and kept
in the output text for the parser.
"""

from __future__ import annotations

import json
from typing import Any

from tgis.params import JSON_OPTIONS, GrammarSpec
from tgis.server.chat.reasoning import lark_literal, template_text
from tgis.server.chat.tool_calls import COMPACT, ToolChoice, ToolFormat

HERMES = ToolFormat(
    "hermes", trigger="<tool_call>", array=False, separator="\n", call_end="</tool_call>",
    spaced=True,
)  # fmt: skip
LLAMA3_JSON = ToolFormat(
    "llama3_json", trigger="<|python_tag|>", trigger_optional=True, key="parameters",
    array=False, separator="; ", spaced=True,
)  # fmt: skip
MISTRAL = ToolFormat("mistral", trigger="[TOOL_CALLS]", spaced=True)
GRANITE = ToolFormat("granite", trigger="<|tool_call|>", spaced=True)

# Each family with the texts of a template that writes its calls.
FAMILIES: tuple[tuple[ToolFormat, tuple[str, ...]], ...] = (
    (HERMES, ("<tool_call>",)),
    (MISTRAL, ("[TOOL_CALLS]",)),
    (GRANITE, ("<|tool_call|>",)),
    (LLAMA3_JSON, ("<|python_tag|>", '"parameters": dictionary of argument name')),
)

SPACED_JSON = {**JSON_OPTIONS, "item_separator": ", ", "key_separator": ": "}


def find_tool_format(tokenizer: Any) -> ToolFormat:
    """The model's own call format, read from its chat template; tgis's compact one when the
    template has none."""
    template = template_text(tokenizer)
    for fmt, signs in FAMILIES:
        if any(sign in template for sign in signs):
            return fmt
    return COMPACT


def tool_grammar(
    choice: ToolChoice, fmt: ToolFormat, tokenizer: Any, max_tokens: int | None = None
) -> GrammarSpec:
    """The grammar that holds the output to `choice` in format `fmt`, the arguments strict
    (tool_calls.strict_arguments; `max_tokens` bounds their free strings)."""
    if fmt == COMPACT:
        return choice.grammar(max_tokens)
    calls = [t.call_schema(max_tokens, fmt.key) for t in choice.callable()]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    single = not choice.parallel or choice.mode == "named"
    if fmt.array:
        schema: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
        if single:
            schema["maxItems"] = 1
        body = _json(schema)
        first = rest = ""
    else:
        body = "call"
        first, rest = _call_rule(fmt, body, tokenizer)
    trigger = lark_literal(tokenizer, fmt.trigger) if fmt.trigger is not None else None
    lines = []
    if fmt.array:
        # The calls' array after the trigger (Mistral's templates put a space before it).
        space = '" "? ' if fmt == MISTRAL else ""
        lines.append(f"tail: {space}{body}")
    else:
        lines.append(f"tail: first{'' if single else ' (SEP rest)*'}")
        lines += [f"first: {first}", f"rest: {rest}", f"SEP: {json.dumps(fmt.separator)}"]
        lines.append(f"call: {_json(one)}")
    if choice.mode != "auto":
        lead = "" if trigger is None else f"{trigger}{'?' if fmt.trigger_optional else ''} "
        lines.insert(0, f"start: {lead}tail")
    elif fmt.leads_with_text:
        assert trigger is not None
        lazy = "" if trigger.startswith("<[") else "[lazy]"
        lines.insert(0, "start: TEXT | lead tail")
        lines += [f"lead{lazy}: TEXT {trigger}", r"TEXT: /(.|\n)*/"]
    else:
        lines.insert(0, f"start: {trigger}? tail | PLAIN?" if trigger else "start: tail | PLAIN?")
        lines.append(r"PLAIN: /[^{\[][\s\S]*/")
    return GrammarSpec.lark("\n".join(lines) + "\n", source="tools")


def _call_rule(fmt: ToolFormat, body: str, tokenizer: Any) -> tuple[str, str]:
    """The first call (its trigger, if any, already written) and each later one."""
    if not fmt.call_end:
        return body, body
    assert fmt.trigger is not None
    trigger, end = lark_literal(tokenizer, fmt.trigger), lark_literal(tokenizer, fmt.call_end)
    first = f'"\\n" {body} "\\n" {end}'
    return first, f"{trigger} {first}"


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": SPACED_JSON})
