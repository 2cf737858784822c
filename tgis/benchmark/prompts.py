"""Prompts of exact token counts, cut offline from a corpus bundled with every Python.

The corpus is the source of the Python standard library (`sysconfig.get_paths()["stdlib"]`):
every machine that runs tgis has it, it needs no download, and it is varied text (code,
docstrings, comments). Its files are read in sorted order, so for one Python version and one
seed the prompts are identical from run to run (another Python version has other sources).

A prompt of n tokens is a slice of the corpus, starting at a line picked by the seeded RNG,
whose encoding with the target's tokenizer (without special tokens: no BOS) is exactly n ids.
The slice is cut in text, not by decoding ids, so the server re-encodes the same n ids even
for tokenizers that map unknown characters to `<unk>`.

A profile with images gives the first turn of each session its images (data URLs, see
`images.image_sets`), drawn from the same seed but not from the text's random stream: the texts
of a seed are the same with images or without.
"""

from __future__ import annotations

import dataclasses
import random
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tgis.benchmark.images import image_sets
from tgis.benchmark.profiles import Profile

CORPUS_CHARS = 4_000_000
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3"}


@dataclass(frozen=True)
class Turn:
    """One user message of `tokens` tokens, answered with at most `max_new_tokens` tokens;
    `images` (data URLs) come before its text. `tokens` counts the text only."""

    text: str
    tokens: int
    max_new_tokens: int
    images: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class Session:
    """A conversation: its turns run one after the other (one turn for single-shot profiles)."""

    turns: tuple[Turn, ...]


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's `.py` files, sorted (tests and vendored packages left out)."""
    base = root or Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in base.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(base).parts)
    )


@lru_cache(maxsize=2)
def load_corpus(max_chars: int = CORPUS_CHARS) -> str:
    """About `max_chars` characters of standard-library source, files in sorted order."""
    parts: list[str] = []
    size = 0
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    if not parts:
        raise RuntimeError("the Python standard library's sources were not found")
    return "\n".join(parts)


def count_tokens(tokenizer: Any, text: str) -> int:
    """Token count of `text` without special tokens (transformers or `tokenizers` tokenizer)."""
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return len(encoded.ids if hasattr(encoded, "ids") else encoded)


def _cut(tokenizer: Any, corpus: str, start: int, tokens: int) -> str | None:
    """The prefix of corpus[start:] of exactly `tokens` tokens, or None if none exists."""
    # Grow an upper bound, then binary-search the longest prefix of at most `tokens` tokens.
    hi = tokens * 4
    while count_tokens(tokenizer, corpus[start : start + hi]) < tokens:
        if start + hi >= len(corpus):
            return None
        hi *= 2
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(tokenizer, corpus[start : start + mid]) <= tokens:
            lo = mid
        else:
            hi = mid
    # Counts are not strictly monotonic in the prefix length: look a little around the cut.
    for length in (lo, *range(lo + 1, lo + 9), *range(lo - 1, max(lo - 9, 0), -1)):
        text = corpus[start : start + length]
        if count_tokens(tokenizer, text) == tokens:
            return text
    return None


def make_prompt(
    tokenizer: Any, tokens: int, rng: random.Random, corpus: str | None = None, attempts: int = 20
) -> str:
    """A corpus slice of exactly `tokens` tokens, starting at a line chosen with `rng`."""
    if tokens < 1:
        raise ValueError(f"a prompt needs at least 1 token, got {tokens}")
    text = load_corpus() if corpus is None else corpus
    for _ in range(attempts):
        start = rng.randrange(max(1, len(text) - tokens * 8))
        newline = text.find("\n", start)
        start = newline + 1 if 0 <= newline < len(text) - 1 else start
        prompt = _cut(tokenizer, text, start, tokens)
        if prompt is not None:
            return prompt
    raise ValueError(f"could not cut a prompt of exactly {tokens} tokens from the corpus")


def build_sessions(
    profile: Profile, tokenizer: Any, count: int, seed: int, corpus: str | None = None
) -> list[Session]:
    """`count` sessions of `profile`, all lengths, texts and images fixed by `seed`."""
    rng = random.Random(seed)
    images = image_sets(profile.images, count, seed) if profile.images else [()] * count
    sessions = []
    for index in range(count):
        turns = []
        for _ in range(profile.turns):
            tokens = profile.prompt.sample(rng)
            new_tokens = profile.decode.sample(rng)
            if profile.echo:
                turns.append(_echo_turn(tokenizer, tokens, new_tokens, rng, corpus))
                continue
            turns.append(Turn(make_prompt(tokenizer, tokens, rng, corpus), tokens, new_tokens))
        if images[index]:
            turns[0] = dataclasses.replace(turns[0], images=images[index])
        sessions.append(Session(tuple(turns)))
    return sessions


ECHO_REQUEST = "\n\n# The same code, with its comments kept:\n"


def _echo_turn(
    tokenizer: Any, tokens: int, new_tokens: int, rng: random.Random, corpus: str | None
) -> Turn:
    """A code-editing prompt of about `tokens` tokens: a piece of code, a request to write it
    again, and its first line; the turn records the prompt's exact token count."""
    code = make_prompt(tokenizer, max(1, tokens * 3 // 4), rng, corpus)
    text = code + ECHO_REQUEST + code.split("\n", 1)[0] + "\n"
    return Turn(text, count_tokens(tokenizer, text), new_tokens)
