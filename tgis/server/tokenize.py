"""`/tokenize`'s answer: each token with its text and byte span in the input, as TGI gives it."""

from __future__ import annotations

from typing import Any

from tgis.errors import InputValidationError
from tgis.params import truncate_ids


def tokenize_with_offsets(tokenizer: Any, text: str, truncate: int | None) -> list[dict[str, Any]]:
    """TGI's SimpleToken list: {id, text, start, stop}, with `start`/`stop` in bytes of `text`.

    Special tokens the tokenizer adds (BOS) have an empty span. `truncate` keeps the last
    tokens, as generation does. Tokenizers without offsets (slow, Python ones) give each
    token's decoded text and a 0..0 span, as TGI does without a fast tokenizer.
    """
    if truncate is not None and truncate <= 0:
        raise InputValidationError(f"`truncate` must be strictly positive. Given: {truncate}")
    try:
        encoding = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        offsets: list[tuple[int, int]] | None = list(encoding["offset_mapping"])
        ids = list(encoding["input_ids"])
    except NotImplementedError:
        ids, offsets = list(tokenizer.encode(text, add_special_tokens=True)), None
    kept = truncate_ids(ids, truncate)
    first = len(ids) - len(kept)
    if offsets is None:
        return [{"id": i, "text": tokenizer.decode([i]), "start": 0, "stop": 0} for i in kept]
    # Python's offsets count characters; TGI's (Rust) count UTF-8 bytes.
    byte_at = [0]
    for char in text:
        byte_at.append(byte_at[-1] + len(char.encode()))
    tokens = []
    for token_id, (start, stop) in zip(kept, offsets[first:], strict=True):
        tokens.append(
            {
                "id": token_id,
                "text": text[start:stop],
                "start": byte_at[start],
                "stop": byte_at[stop],
            }
        )
    return tokens
