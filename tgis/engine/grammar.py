"""Output constrained to a JSON schema or a regular expression, with llguidance.

A request's `GrammarSpec` (tgis.params) is checked when it is validated (schema and regex
errors, without the tokenizer), compiled into a `Constraint` per sequence when the engine admits
it, and applied at every step: the constraint gives the bitmask of the tokens its grammar allows
next, the sampler sets every other token's score to -inf before any processor, and the chosen
token advances it. The next mask is computed in a worker thread as soon as the token is known
(llguidance releases the GIL), so it is ready by the time the next forward has run.

Once the grammar is complete it allows only EOS, so a constrained sequence ends with
`eos_token`; one that cannot complete within max_new_tokens ends with `length`.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tgis.engine.detokenize import tokenizer_facts
from tgis.params import GrammarSpec

log = logging.getLogger("tgis.engine")

# Token t is bit t % 32 of word t // 32 of llguidance's mask, least significant first.
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tgis-grammar")


# How long a request with a grammar waits for the tokenizer's llguidance form while it is built.
BUILD_WAIT_S = 60.0


class GrammarCompiler:
    """Builds constraints over one tokenizer. Its llguidance form is made once: by `prepare`, in
    a thread of its own (`tgis serve` serves meanwhile; a grammar request waits for it), else
    by the first constraint, on the calling thread."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        # Why the tokenizer has no llguidance form (llguidance cannot take it), once built.
        self.error: str | None = None
        # Seconds the build took, once built.
        self.build_s: float | None = None
        self._lock = threading.Lock()
        self._started = False
        # Done when the build ended, either way. Running from the start: waiting for it with
        # a timeout (asyncio.wrap_future) never cancels it.
        self.built: Future[None] = Future()
        self.built.set_running_or_notify_cancel()

    @property
    def ready(self) -> bool:
        """The build ended: constraints are made at once (or fail with `error`)."""
        return self.built.done()

    def prepare(self) -> None:
        """Start building the tokenizer's llguidance form in a thread of its own (a vocabulary
        walk: up to a second or two for a large vocabulary), so that no request waits for it
        on the engine's thread. It logs how long the build took, or why it failed."""
        if self._claim():
            name = "tgis-grammar-tokenizer"
            threading.Thread(target=self._build, args=(True,), name=name, daemon=True).start()

    def _claim(self) -> bool:
        """Whether the caller is the one to build (the first to ask)."""
        with self._lock:
            mine, self._started = not self._started, True
        return mine

    def _build(self, report: bool = False) -> None:
        start = time.perf_counter()
        try:
            self._ll_tokenizer = llguidance_tokenizer(self.tokenizer, self.eos_token_ids)
        except Exception as exc:  # llguidance cannot take this tokenizer: grammars fail
            self.error = str(exc) or type(exc).__name__
        self.build_s = time.perf_counter() - start
        if report and self.error is not None:
            log.warning("structured output is unavailable with this tokenizer: %s", self.error)
        elif report:
            log.info("structured output ready: grammar tokenizer built in %.2f s", self.build_s)
        self.built.set_result(None)

    def wait(self, timeout: float | None = BUILD_WAIT_S) -> bool:
        """Wait for the build (started now, in its thread, if nobody started it); whether it
        ended within `timeout` seconds."""
        self.prepare()
        try:
            self.built.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def _tokenizer(self) -> Any:
        if self._claim():
            self._build()
        elif not self.wait():
            raise ValueError(
                f"structured output is not ready: its tokenizer is still being built after "
                f"{BUILD_WAIT_S:.0f} s"
            )
        if self._ll_tokenizer is None:
            raise ValueError(f"structured output is unavailable with this tokenizer: {self.error}")
        return self._ll_tokenizer

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A new sequence's constraint (its first mask starts computing at once). Raises
        ValueError when the grammar is unusable, or the tokenizer."""
        import llguidance as llg

        tokenizer = self._tokenizer()
        limits = llg.LLParserLimits(verbose_errors=False)
        matcher = llg.LLMatcher(tokenizer, spec.grammar(), log_level=0, limits=limits)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {matcher.get_error()}")
        return Constraint(matcher, tokenizer.vocab_size)


def llguidance_tokenizer(tokenizer: Any, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's form of a transformers tokenizer, as `llguidance.hf.from_tokenizer` makes
    it (its error for one it cannot take), over the tokenizer's whole size (its
    `TokenizerFacts.vocab_size`). A byte-level BPE tokenizer's plain added tokens go over as
    `added_tokens_in_vocabulary` writes them."""
    import llguidance
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    size = tokenizer_facts(tokenizer).vocab_size
    eos = list(eos_token_ids) or getattr(tokenizer, "eos_token_id", None)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=size, eos_token=eos)
    # As from_tokenizer: the Rust tokenizer's JSON, added tokens included, without padding
    # and truncation (turned off on a copy where they are on: a copy takes longer than the JSON).
    backend = tokenizer.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
    text = added_tokens_in_vocabulary(backend.to_str())
    return llguidance.LLTokenizer(text, n_vocab=size, eos_token=eos)


def added_tokens_in_vocabulary(serialized: str) -> str:
    """A byte-level BPE tokenizer's JSON (`tokenizers.Tokenizer.to_str`) with its added tokens
    that are not special moved into its model's vocabulary, each spelled as the bytes llguidance
    reads an added token as: its text, after llguidance's special-token marker (0xFF) where
    llguidance takes it for a special token (a text in angle brackets, such as
    `<|unused_0|>`). The same tokenizer to llguidance (each id's bytes and special flag, so
    every mask), read in linear time: its tokenizer library takes time quadratic in the added
    tokens (45–80 s for the 87k of a 40k-token vocabulary padded to 128k, 1 s so). Special tokens
    stay (grammars name them), and so does any other tokenizer's JSON.
    """
    if '"ByteLevel"' not in serialized:
        return serialized
    data = json.loads(serialized)
    model, decoder = data.get("model") or {}, data.get("decoder") or {}
    vocab = model.get("vocab")
    added = data.get("added_tokens") or []
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        return serialized
    if not isinstance(vocab, dict) or all(token.get("special") for token in added):
        return serialized
    chars = _byte_level_chars()
    taken = set(vocab.values())
    kept = []
    for token in added:
        text = token["content"]
        marked = text.startswith("<") and text.endswith(">")
        spelled = "".join(chars[b] for b in (b"\xff" if marked else b"") + text.encode())
        if token.get("special") or token["id"] in taken or spelled in vocab:
            kept.append(token)
        else:
            vocab[spelled] = token["id"]
    data["added_tokens"] = kept
    return json.dumps(data, ensure_ascii=False)


def _byte_level_chars() -> list[str]:
    """The character a byte-level vocabulary writes each byte as (GPT-2's: printable Latin-1
    characters stand for themselves, the other bytes for U+0100 onwards in order)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(0x100 + extra))
            extra += 1
    return chars


class Constraint:
    """One sequence's grammar state. The engine thread advances it; its masks are computed in
    a worker thread (one owner at a time: `advance` and `allowed` wait for that work)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._pending: Future[torch.Tensor] | None = _WORKER.submit(self._mask)

    def copy(self) -> Constraint:
        """An independent constraint in the same state (another best_of candidate)."""
        if self._pending is not None:
            self._pending.result()  # the matcher has one owner at a time; the mask is kept
        return Constraint(self._matcher.deep_copy(), self.vocab_size)

    def _settle(self) -> torch.Tensor | None:
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _mask(self) -> torch.Tensor:
        bitmask = torch.empty(self._words, dtype=torch.int32)
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), self._words * 4)
        return bitmask

    def packed(self, width: int) -> torch.Tensor:
        """The tokens the grammar allows next as a bitmask of `width` ids: int32
        [ceil(width / 32)], bit j of word w for id 32 w + j (ids past the tokenizer's
        vocabulary, a model's padding, are never allowed). What a step uploads: 1/8 of a bool
        mask's bytes."""
        bitmask = self._settle()
        if bitmask is None:
            bitmask = self._mask()
        return pack_to_width(bitmask, self.vocab_size, width)

    def allowed(self, width: int) -> torch.Tensor:
        """The tokens the grammar allows next, as a bool [width]."""
        return unpack(self.packed(width), width)

    def advance(self, token_id: int) -> None:
        """Consume the chosen token and start computing the next mask. Raises ValueError if
        the grammar does not allow it."""
        self._settle()
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"the grammar does not allow token {token_id}")
        if not self._matcher.is_stopped():
            self._pending = _WORKER.submit(self._mask)

    def masks_ahead(self, draft: Sequence[int], width: int) -> list[KnownMask | None]:
        """The masks after each prefix of `draft` (speculative decoding: position j + 1 is
        scored after draft[:j + 1]), from a copy: this constraint does not move. None from the
        first draft token the grammar does not allow: that token is rejected (its score is
        -inf), so nothing after it is scored for use."""
        walker = self.copy()
        masks = masks_along(walker, draft, width)
        walker._settle()
        return masks

    @property
    def complete(self) -> bool:
        """The output matches the whole grammar and nothing may follow but EOS."""
        return bool(self._matcher.is_stopped())


def masks_along(
    walker: Any, draft: Sequence[int], width: int, checked: bool = False
) -> list[KnownMask | None]:
    """The masks of `walker` (a constraint's copy, moved here) after each token of `draft`;
    None from the first token it does not take: its `advance` raises ValueError, or with
    `checked`, the mask before the token does not allow it."""
    masks: list[KnownMask | None] = []
    before = walker.packed(width) if checked else None  # None: every token allowed
    for token in draft:
        refused = bool(masks) and masks[-1] is None
        if not refused and before is not None:
            refused = not (int(before[token // 32]) >> (token % 32)) & 1
        if not refused:
            try:
                walker.advance(token)
            except ValueError:
                refused = True
        if refused:
            masks.append(None)
            continue
        mask = walker.packed(width)
        before = mask if checked else None
        masks.append(KnownMask(mask))
    return masks


class KnownMask:
    """A mask computed ahead (`Constraint.masks_ahead`), in the place of a constraint for
    scoring one speculative position: a bitmask as `Constraint.packed` gives it (None: every
    token allowed, as a reasoning budget not yet spent gives it)."""

    def __init__(self, packed: torch.Tensor | None) -> None:
        self._packed = packed

    def packed(self, width: int) -> torch.Tensor | None:
        if self._packed is None:
            return None
        words = (width + 31) // 32
        if words == self._packed.shape[0]:
            return self._packed
        return pack_to_width(self._packed, self._packed.shape[0] * 32, width)

    def allowed(self, width: int) -> torch.Tensor:
        packed = self.packed(width)
        return torch.ones(width, dtype=torch.bool) if packed is None else unpack(packed, width)


def pack_to_width(bitmask: torch.Tensor, valid: int, width: int) -> torch.Tensor:
    """`bitmask` (int32 words, ids below `valid` meaningful) as the bitmask of `width` ids:
    bits of ids at or past `valid` cleared, words added or dropped to ceil(width / 32)."""
    out = torch.zeros((width + 31) // 32, dtype=torch.int32)
    full, rest = divmod(min(valid, width), 32)
    out[:full] = bitmask[:full]
    if rest:
        out[full] = bitmask[full] & ((1 << rest) - 1)
    return out


def unpack(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [..., width] of int32 bitmasks [..., ceil(width / 32)] (on their device)."""
    shifts = _BIT_SHIFTS.to(packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :width].bool()
