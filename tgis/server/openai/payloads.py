"""OpenAI's response JSON: completions, chat completions, their stream chunks, logprobs, usage."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tgis.engine.types import TokenInfo
from tgis.server.http.info import ModelInfo


@dataclass(frozen=True)
class Envelope:
    """The fields every response and chunk of one request shares."""

    id: str
    object: str
    model: str
    system_fingerprint: str
    created: int

    @staticmethod
    def new(
        request_id: str, chat: bool, stream: bool, info: ModelInfo, adapter: str | None = None
    ) -> Envelope:
        """`model` is the served model's id, or the LoRA adapter's name the request chose."""
        if chat:
            prefix, obj = "chatcmpl-", "chat.completion.chunk" if stream else "chat.completion"
        else:
            prefix, obj = "cmpl-", "text_completion"
        return Envelope(
            prefix + request_id,
            obj,
            adapter or info.model_id,
            info.system_fingerprint,
            int(time.time()),
        )

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
            **extra,
        }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    tokens: Sequence[TokenInfo],
    tops: Sequence[Sequence[TokenInfo]],
    top_n: int,
    offset: int = 0,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object; `offset` is the first token's text offset."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    padded = list(tops) + [()] * (len(tokens) - len(tops))
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{t.text: t.logprob for t in step[:top_n]} for step in padded]
        if top_n
        else None,
        "text_offset": offsets,
    }


def _chat_logprob(token: TokenInfo) -> dict[str, Any]:
    return {"token": token.text, "logprob": token.logprob, "bytes": list(token.text.encode())}


def chat_logprobs(
    tokens: Sequence[TokenInfo], tops: Sequence[Sequence[TokenInfo]], top_n: int
) -> dict[str, Any]:
    """The chat `logprobs` object: one entry per token with its top alternatives."""
    padded = list(tops) + [()] * (len(tokens) - len(tops))
    return {
        "content": [
            {**_chat_logprob(t), "top_logprobs": [_chat_logprob(a) for a in step[:top_n]]}
            for t, step in zip(tokens, padded, strict=True)
        ]
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, message: dict[str, Any], finish_reason: str, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", **message},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A chat output delta as OpenAI's chunk writes it: reasoning under both of its names
    (`reasoning_content`, as SGLang and llama.cpp write it, and vLLM's `reasoning`)."""
    if "reasoning" in delta:
        return {"reasoning_content": delta["reasoning"], "reasoning": delta["reasoning"]}
    return delta


def chat_delta_choice(
    index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def sse(data: dict[str, Any] | str) -> str:
    """One OpenAI server-sent event (`data: ` with a space; `[DONE]` ends a stream)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"
