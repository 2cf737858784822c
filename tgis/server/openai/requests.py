"""OpenAI request bodies -> GenerateParameters (and the choices to build from them).

Mapping, following TGI's and OpenAI's documented semantics:
- `temperature` 0 is greedy decoding; absent means OpenAI's default (sampling at 1.0).
- `top_p` 1.0 and penalties of 0 mean "off" and are dropped (TGI rejects top_p = 1.0).
- `stop` (string or list) cuts the text before the stop sequence, as OpenAI does.
- `n` > 1 asks the engine for n sequences (its best_of machinery) and returns all of them,
  so it needs sampling and is bounded by --max-best-of.
- `max_tokens` defaults to 16 on /v1/completions (OpenAI's default) and to the server's limit
  on /v1/chat/completions; `max_completion_tokens` is the newer name of the latter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tgis.params import GenerateParameters
from tgis.server.chat.options import response_format, temperature_top_p, template_kwargs
from tgis.server.chat.tool_calls import ToolChoice, parse_message_tool_calls, parse_tools
from tgis.server.http.errors import invalid
from tgis.server.http.fields import Fields
from tgis.server.http.info import ModelInfo

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed /v1/completions or /v1/chat/completions request."""

    # Completions: one or more prompts (text or token ids). Chat: the messages.
    prompts: tuple[str | tuple[int, ...], ...]
    messages: tuple[dict[str, Any], ...]
    params: GenerateParameters
    n: int
    stream: bool
    include_usage: bool
    # Completions: top alternatives per token (0: the chosen token only). Chat: top_logprobs.
    # None: no logprobs.
    logprobs: int | None
    echo: bool = False
    # TGIS's tuned prompt prefix (`prefix_id`, an extension of OpenAI's API).
    prefix_id: str | None = None
    # Chat: the tools the model may call (None: none, or `tool_choice` "none").
    tools: ToolChoice | None = None
    # `model` as sent: the served model, or one of its LoRA adapters.
    model: str | None = None
    # Chat: extra variables of the chat template (`chat_template_kwargs`, `reasoning_effort`).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Chat: whether the reasoning is returned (`include_reasoning`; it is parsed out anyway).
    include_reasoning: bool = True


def _sampling(f: Fields, info: ModelInfo, max_tokens: int | None) -> dict[str, Any]:
    """The GenerateParameters fields both OpenAI routes share."""
    values: dict[str, Any] = {
        **temperature_top_p(f),
        "seed": f.integer("seed", unsigned=True),
        "max_new_tokens": max_tokens,
        "stop": f.strings("stop", allow_single=True),
        "include_stop_sequence": False,
        # Extensions that vLLM and TGI accept too.
        "top_k": f.integer("top_k"),
        "repetition_penalty": f.number("repetition_penalty"),
        "min_new_tokens": f.integer("min_tokens", unsigned=True),
        "ignore_eos": f.boolean("ignore_eos"),
    }
    for key in ("frequency_penalty", "presence_penalty"):
        value = f.number(key)
        values[key] = None if value == 0.0 else value
    values["logit_bias"] = _logit_bias(f)
    n = f.integer("n", unsigned=True)
    n = 1 if n is None else n
    if n < 1:
        raise invalid("`n` must be at least 1")
    if n > 1:
        if n > info.max_best_of:
            raise invalid(
                f"`n` must be <= {info.max_best_of} (the server's --max-best-of). Given: {n}"
            )
        if not values["do_sample"]:
            raise invalid("`n` > 1 needs sampling: set `temperature` above 0")
        values["best_of"] = n
    values["n"] = n
    return values


def _logit_bias(f: Fields) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's `logit_bias`: an object of token ids (as strings) to biases."""
    given = f.data.get("logit_bias")
    if given is None:
        return None
    if not isinstance(given, dict):
        raise invalid("`logit_bias` must be an object of token ids to numbers")
    pairs = []
    for key, value in given.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise invalid(f"`logit_bias` keys must be token ids (digits). Given: {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(f"`logit_bias` values must be numbers. Given: {value!r} for {key}")
        pairs.append((int(key), float(value)))
    return tuple(pairs) or None


def _stream_options(f: Fields) -> tuple[bool, bool]:
    stream = bool(f.boolean("stream"))
    options = f.obj("stream_options")
    include_usage = bool(options.boolean("include_usage")) if options is not None else False
    if options is not None and not stream:
        raise invalid("`stream_options` is only allowed when `stream` is true")
    return stream, include_usage


def _params(values: dict[str, Any]) -> GenerateParameters:
    fields = {k: v for k, v in values.items() if v is not None and k != "n"}
    return GenerateParameters(**fields)


def parse_completion_request(
    body: Any, info: ModelInfo, max_new_tokens: int | None = None
) -> OpenAIRequest:
    """POST /v1/completions. `max_new_tokens`: the server's --max-new-tokens, which caps the
    default of `max_tokens` too."""
    f = Fields(body)
    prompts = _prompts(f, info)
    if f.has("suffix"):
        raise invalid("`suffix` is not supported and can be achieved by preprocessing the prompt")
    max_tokens = f.integer("max_tokens", unsigned=True)
    if max_tokens is None:
        max_tokens = min(
            COMPLETIONS_DEFAULT_MAX_TOKENS, max_new_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        )
    values = _sampling(f, info, max_tokens)
    stream, include_usage = _stream_options(f)
    logprobs = f.integer("logprobs", unsigned=True)
    if logprobs is not None and logprobs > info.max_top_n_tokens:
        raise invalid(f"`logprobs` must be <= {info.max_top_n_tokens}. Given: {logprobs}")
    if logprobs:
        values["top_n_tokens"] = logprobs
    echo = bool(f.boolean("echo"))
    if echo and logprobs is not None:
        if stream:
            raise invalid("`echo` with `logprobs` is not supported when streaming")
        values["decoder_input_details"] = True
    best_of = f.integer("best_of", unsigned=True)
    if best_of is not None and best_of != values["n"]:
        raise invalid("`best_of` is only supported equal to `n`")
    return OpenAIRequest(
        prompts=prompts,
        messages=(),
        params=_params(values),
        n=values["n"],
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        echo=echo,
        prefix_id=f.string("prefix_id"),
        model=f.string("model"),
    )


def _prompts(f: Fields, info: ModelInfo) -> tuple[str | tuple[int, ...], ...]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of such lists."""
    value = f.data.get("prompt")
    expected = "a string, an array of strings, or (arrays of) token ids"
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        prompts: tuple[str | tuple[int, ...], ...] = tuple(value)
    elif isinstance(value, list) and value and all(_is_ids(v) for v in value):
        prompts = (tuple(int(v) for v in value),)
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(v, list) and v and _all_ids(v) for v in value)
    ):
        prompts = tuple(tuple(int(i) for i in v) for v in value)
    elif value is None:
        raise invalid("missing field `prompt`")
    else:
        raise invalid(f"`prompt` must be {expected}")
    if len(prompts) > info.max_client_batch_size:
        raise invalid(
            f"Number of prompts exceeds the maximum allowed batch size of {info.max_client_batch_size}"
        )
    return prompts


def _is_ids(value: Any) -> bool:
    """A token id: a non-negative integer (JSON's 7.0 is 7, as for every integer field)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _all_ids(values: list[Any]) -> bool:
    return all(_is_ids(v) for v in values)


def parse_chat_request(body: Any, info: ModelInfo) -> OpenAIRequest:
    """POST /v1/chat/completions (`max_tokens` defaults to what fits: tgis.params.validate)."""
    f = Fields(body)
    messages = _messages(f)
    tools = parse_tools(f)
    grammar = response_format(f)
    if tools is not None and grammar is not None:
        raise invalid(
            '`response_format` cannot be combined with `tools` (unless `tool_choice` is "none"): '
            "both constrain the output"
        )
    max_tokens = f.integer("max_completion_tokens", unsigned=True)
    if max_tokens is None:
        max_tokens = f.integer("max_tokens", unsigned=True)
    values = _sampling(f, info, max_tokens)
    values["grammar"] = grammar
    stream, include_usage = _stream_options(f)
    top = f.integer("top_logprobs", unsigned=True)
    logprobs: int | None = None
    if f.boolean("logprobs"):
        logprobs = top or 0
        if logprobs > info.max_top_n_tokens:
            raise invalid(f"`top_logprobs` must be <= {info.max_top_n_tokens}. Given: {logprobs}")
        if logprobs:
            values["top_n_tokens"] = logprobs
    elif top:
        raise invalid("`top_logprobs` needs `logprobs` set to true")
    return OpenAIRequest(
        prompts=(),
        messages=messages,
        params=_params(values),
        n=values["n"],
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        prefix_id=f.string("prefix_id"),
        tools=tools,
        model=f.string("model"),
        template_kwargs=template_kwargs(f),
        include_reasoning=f.boolean("include_reasoning") is not False,
    )


def _messages(f: Fields) -> tuple[dict[str, Any], ...]:
    value = f.data.get("messages")
    if not isinstance(value, list) or not value:
        raise invalid("`messages` must be a non-empty array of messages")
    messages = []
    for i, raw in enumerate(value):
        m = Fields(raw, f"messages[{i}]")
        message: dict[str, Any] = {"role": m.required_string("role")}
        content = m.data.get("content")
        if isinstance(content, list):
            parts = [
                _content_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)
            ]
            images = any(part["type"] == "image" for part in parts)
            content = parts if images else "".join(part["text"] for part in parts)
        elif content is not None and not isinstance(content, str):
            raise invalid(
                f"`messages[{i}].content` must be a string or an array of text and image_url parts"
            )
        message["content"] = content or ""
        for key in ("name", "tool_call_id"):
            if m.string(key) is not None:
                message[key] = m.string(key)
        if m.has("tool_calls"):
            message["tool_calls"] = parse_message_tool_calls(
                m.data["tool_calls"], f"messages[{i}].tool_calls"
            )
        messages.append(message)
    return tuple(messages)


def _content_part(part: Any, path: str) -> dict[str, str]:
    """A content part: {"type": "text", "text"} or, from an image_url part, {"type":
    "image", "url", "field"} (read later: tgis.server.http.images)."""
    p = Fields(part, path)
    kind = p.string("type")
    if kind == "text":
        return {"type": "text", "text": p.required_string("text")}
    if kind == "image_url":
        image = p.data.get("image_url")
        url = image if isinstance(image, str) else Fields(image, f"{path}.image_url").string("url")
        if not url:
            raise invalid(f"`{path}.image_url.url` must be the image's URL (or data URL)")
        return {"type": "image", "url": url, "field": f"{path}.image_url.url"}
    raise invalid(
        f'`{path}.type` must be "text" or "image_url"; this server takes no {kind!r} parts'
    )
