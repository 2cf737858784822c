"""TGI's response JSON (router/src/lib.rs): GenerateResponse, Details, StreamResponse, tokens.

Field presence follows TGI's serde attributes: `details` is absent unless asked for,
`top_tokens` is absent when empty, `best_of_sequences` only with best_of > 1, `seed` is null
for greedy decoding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tgis.engine.types import Completion, TokenEvent, TokenInfo
from tgis.server.http.generation import SequenceResult


def token_json(token: TokenInfo, text: str | None = None) -> dict[str, Any]:
    """TGI's Token: id, text, logprob, special."""
    return {
        "id": token.id,
        "text": token.text if text is None else text,
        "logprob": token.logprob,
        "special": token.special,
    }


def prefill_json(token: TokenInfo) -> dict[str, Any]:
    """TGI's PrefillToken: id, text, logprob (null for the first prompt token)."""
    return {"id": token.id, "text": token.text, "logprob": token.logprob}


def _top_tokens(steps: Sequence[Sequence[TokenInfo]]) -> list[list[dict[str, Any]]]:
    return [[token_json(t) for t in step] for step in steps]


def _sequence_fields(result: SequenceResult) -> dict[str, Any]:
    c = result.completion
    fields: dict[str, Any] = {
        "finish_reason": c.finish_reason.value,
        "generated_tokens": c.generated_tokens,
        "seed": c.seed,
        "prefill": [prefill_json(t) for t in c.prefill],
        "tokens": [token_json(t) for t in result.details_tokens],
    }
    tops = result.details_top_tokens
    if any(tops):
        fields["top_tokens"] = _top_tokens(tops)
    return fields


def generate_response(
    best: SequenceResult,
    others: Sequence[SequenceResult],
    *,
    details: bool,
    prefix: str,
    best_of: bool,
) -> dict[str, Any]:
    """TGI's GenerateResponse for the best sequence (and the other best_of candidates)."""
    body: dict[str, Any] = {"generated_text": prefix + best.completion.generated_text}
    if details:
        body["details"] = _sequence_fields(best)
        if best_of:
            body["details"]["best_of_sequences"] = [
                {"generated_text": prefix + r.completion.generated_text, **_sequence_fields(r)}
                for r in others
            ]
    return body


def stream_details(completion: Completion) -> dict[str, Any]:
    """TGI's StreamDetails, sent with the last event."""
    return {
        "finish_reason": completion.finish_reason.value,
        "generated_tokens": completion.generated_tokens,
        "seed": completion.seed,
        "input_length": completion.input_length,
    }


def stream_event(index: int, event: TokenEvent, *, details: bool, prefix: str) -> dict[str, Any]:
    """TGI's StreamResponse for one event; `index` counts events from 1.

    The token's text is the text the event makes visible, so the texts of a stream add up to
    its `generated_text` (held-back partial characters and stop-sequence prefixes included).
    """
    body: dict[str, Any] = {"index": index, "token": token_json(event.token, event.text)}
    if event.top_tokens:
        body["top_tokens"] = [token_json(t) for t in event.top_tokens]
    done = event.completion
    body["generated_text"] = None if done is None else prefix + done.generated_text
    body["details"] = stream_details(done) if done is not None and details else None
    return body


def sse(data: dict[str, Any]) -> str:
    """One TGI server-sent event (`data:` without a space, as TGI's router writes it)."""
    return f"data:{json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"
