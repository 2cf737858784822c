"""`/tokenize`'s answer: each token with its text and byte span in the input, as TGI gives it.

A vision-language model's prompt holds markdown images; their tokens (the image's rows, and
any markers its processor writes around them) span the markdown image that stands for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher
from typing import Any

from tgis.errors import InputValidationError
from tgis.params import truncate_ids


def check_truncate(truncate: int | None) -> None:
    """TGI's refusal of a `truncate` that keeps no token."""
    if truncate is not None and truncate <= 0:
        raise InputValidationError(f"`truncate` must be strictly positive. Given: {truncate}")


def tokenize_with_offsets(tokenizer: Any, text: str, truncate: int | None) -> list[dict[str, Any]]:
    """TGI's SimpleToken list: {id, text, start, stop}, with `start`/`stop` in bytes of `text`.

    Special tokens the tokenizer adds (BOS) have an empty span. `truncate` keeps the last
    tokens, as generation does. Tokenizers without offsets (slow, Python ones) give each
    token's decoded text and a 0..0 span, as TGI does without a fast tokenizer.
    """
    check_truncate(truncate)
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
    return _simple_tokens(text, kept, offsets[first:])


def _simple_tokens(
    text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]]
) -> list[dict[str, Any]]:
    """SimpleTokens of `ids` whose character spans in `text` are `offsets`."""
    # Python's offsets count characters; TGI's (Rust) count UTF-8 bytes.
    byte_at = [0]
    for char in text:
        byte_at.append(byte_at[-1] + len(char.encode()))
    return [
        {"id": token_id, "text": text[start:stop], "start": byte_at[start], "stop": byte_at[stop]}
        for token_id, (start, stop) in zip(ids, offsets, strict=True)
    ]


def tokenize_with_images(
    tokenizer: Any,
    inputs: str,
    images: Sequence[tuple[int, int]],
    placeholder: str,
    ids: Sequence[int],
) -> list[dict[str, Any]]:
    """The SimpleTokens of a prompt with markdown images: `ids` are the processor's tokens
    of `inputs` with each image's markdown (character spans `images`) replaced by
    `placeholder`. The text tokens keep their spans in `inputs`; the tokens the processor put
    in a placeholder's place (its image tokens, and the markers it writes around them) span
    that image's markdown. (The tokenizer splits at the placeholder, made of special tokens,
    so the text on either side tokenizes alike in both.)"""
    text, marks, to_inputs = _with_placeholders(inputs, images, placeholder)
    encoding = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    plain_spans = list(encoding["offset_mapping"])
    # A placeholder's own tokens match none of the processor's: its whole expansion then
    # replaces them.
    plain = [
        -1 if any(t0 <= start < t1 for t0, t1 in marks) else token
        for token, (start, _) in zip(encoding["input_ids"], plain_spans, strict=True)
    ]
    spans: list[tuple[int, int]] = []
    matcher = SequenceMatcher(None, plain, list(ids), autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            spans += [to_inputs(*plain_spans[a]) for a in range(a0, a1)]
            continue
        # Tokens in a placeholder's place: the span of what they replace (or, inserted
        # beside it, the point where they go).
        at = plain_spans[a0][0] if a0 < len(plain) else len(text)
        replaced = (plain_spans[a0][0], plain_spans[a1 - 1][1]) if a1 > a0 else (at, at)
        spans += [to_inputs(*replaced)] * (b1 - b0)
    return _simple_tokens(inputs, ids, spans)


def _with_placeholders(
    inputs: str, images: Sequence[tuple[int, int]], placeholder: str
) -> tuple[str, list[tuple[int, int]], Any]:
    """`inputs` with each image span replaced by `placeholder`, the placeholders' character
    spans in that text, and the map of a character span of that text back to `inputs` (a
    span touching a placeholder widens to its image)."""
    parts: list[str] = []
    # (start in text, end in text, start in inputs, end in inputs) of each placeholder.
    marks: list[tuple[int, int, int, int]] = []
    at = 0
    length = 0
    for start, end in images:
        parts.append(inputs[at:start])
        length += start - at
        marks.append((length, length + len(placeholder), start, end))
        parts.append(placeholder)
        length += len(placeholder)
        at = end
    parts.append(inputs[at:])

    def position(t: int, end: bool) -> int:
        shift = 0
        for t0, t1, i0, i1 in marks:
            if t < t0 or (t == t0 and end):
                break
            if t < t1 or (t == t1 and end):
                return i1 if end else i0
            shift = i1 - t1
        return t + shift

    def to_inputs(start: int, stop: int) -> tuple[int, int]:
        return position(start, False), max(position(stop, True), position(start, False))

    return "".join(parts), [(t0, t1) for t0, t1, _, _ in marks], to_inputs
