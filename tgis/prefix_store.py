"""Tuned prompt prefixes from a directory (TGIS's PREFIX_STORE_PATH), checked and cached.

`prefix_id` names a directory under the store holding either `decoder.pt` — a 2-D tensor
[virtual tokens, hidden size] saved with `torch.save` — or a PEFT prompt-tuning adapter
(`adapter_config.json` with `peft_type: PROMPT_TUNING`, and `adapter_model.safetensors` or
`adapter_model.bin` holding `prompt_embeddings`). For an encoder-decoder model it holds
`encoder.pt` (before the encoder's input) and/or `decoder.pt` (before the decoder's start
token). Files are read with safetensors or
`torch.load(weights_only=True)` only: loading a prefix never runs code from the file.

Ids match `[/\\w\\-]+`, never contain `..`, and must resolve inside the store (a symbolic
link out of it is refused). A prefix is refused with TGIS's message, `can't retrieve prompt
prefix with id '<id>': <reason>`, when a file is missing or unreadable, or its tensor has the
wrong rank or hidden size, no rows or more virtual tokens than a request may hold, or values
that are not finite (also after conversion to the serving dtype). Loaded prefixes stay in an
LRU cache bounded in bytes.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tgis.engine.types import PromptPrefix
from tgis.errors import InputValidationError
from tgis.peft_files import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    PeftFileError,
    read_config,
    read_weights,
    torch_load,
)

PREFIX_ID = re.compile(r"[/\w\-]+")
# Bytes of loaded prefixes kept in memory (a 100-token prefix of a 4096-wide model in bf16
# is 800 KiB).
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
PEFT_TENSOR = "prompt_embeddings"


class PrefixError(PeftFileError):
    """Why a prefix cannot be used (the reason part of TGIS's message)."""


class PrefixStore:
    """The prompt prefixes of one served model. Thread-safe; `get` may read files."""

    def __init__(
        self,
        root: Path,
        *,
        hidden_size: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity_bytes: int = DEFAULT_CACHE_BYTES,
        encoder_decoder: bool = False,
        model_thread: Callable[[Callable[[], PromptPrefix]], PromptPrefix] | None = None,
    ) -> None:
        """model_thread: runs a load (which moves tensors to the device) on the thread that
        runs the model (`Engine.call`); None: on the calling thread."""
        self.root = root.resolve()
        self.encoder_decoder = encoder_decoder
        self.hidden_size = hidden_size
        self.max_length = max_length
        self.dtype, self.device = dtype, device
        self.capacity_bytes = capacity_bytes
        self._cache: OrderedDict[str, PromptPrefix] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._model_thread = model_thread

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def get(self, prefix_id: str) -> PromptPrefix:
        """The prefix `prefix_id`, from the cache or loaded now. Raises InputValidationError
        with TGIS's message."""
        with self._lock:
            cached = self._cache.get(prefix_id)
            if cached is not None:
                self._cache.move_to_end(prefix_id)
                return cached
        try:
            load = partial(self._load, prefix_id)
            prefix = load() if self._model_thread is None else self._model_thread(load)
        except PeftFileError as exc:
            raise InputValidationError(
                f"can't retrieve prompt prefix with id '{prefix_id}': {exc}"
            ) from None
        with self._lock:
            if prefix_id not in self._cache:
                self._cache[prefix_id] = prefix
                self._bytes += _size(prefix)
                while self._bytes > self.capacity_bytes and len(self._cache) > 1:
                    _, evicted = self._cache.popitem(last=False)
                    self._bytes -= _size(evicted)
            return self._cache[prefix_id]

    def directory(self, prefix_id: str) -> Path:
        """The prefix's directory, inside the store."""
        if not PREFIX_ID.fullmatch(prefix_id) or ".." in prefix_id:
            raise PrefixError("a prefix id is letters, digits, '_', '-' and '/', without '..'")
        path = (self.root / prefix_id).resolve()
        if not path.is_relative_to(self.root):
            raise PrefixError("the id resolves outside the prefix store")
        if not path.is_dir():
            raise PrefixError(f"no directory {prefix_id!r} in the prefix store")
        return path

    def _load(self, prefix_id: str) -> PromptPrefix:
        path = self.directory(prefix_id)
        if self.encoder_decoder:
            return self._load_encoder_decoder(prefix_id, path)
        decoder = path / "decoder.pt"
        if decoder.is_file():
            tensor = torch_load(decoder)
            source = "decoder.pt"
        elif (path / PEFT_CONFIG).is_file():
            tensor = _peft_prompt(path)
            source = PEFT_TENSOR
        else:
            raise PrefixError(
                f"the directory has neither decoder.pt nor a PEFT prompt-tuning adapter "
                f"({PEFT_CONFIG} with {' or '.join(PEFT_WEIGHTS)})"
            )
        embeddings = self._check(tensor, source)
        return PromptPrefix(prefix_id, embeddings, _key(prefix_id, embeddings))

    def _load_encoder_decoder(self, prefix_id: str, path: Path) -> PromptPrefix:
        """encoder.pt (before the encoder's input) and/or decoder.pt (before the decoder's
        start token), as TGIS's store holds them for encoder-decoder models."""
        found = {name: path / f"{name}.pt" for name in ("encoder", "decoder")}
        found = {name: file for name, file in found.items() if file.is_file()}
        if not found:
            raise PrefixError(
                "the directory has neither encoder.pt nor decoder.pt (an encoder-decoder "
                "model's prefix; PEFT adapters are served for decoder-only models)"
            )
        tensors = {name: self._check(torch_load(file), file.name) for name, file in found.items()}
        if sum(t.shape[0] for t in tensors.values()) > self.max_length:
            raise PrefixError(
                f"encoder.pt and decoder.pt have more than {self.max_length} virtual tokens"
            )
        decoder = tensors.get("decoder")
        if decoder is None:
            decoder = torch.empty((0, self.hidden_size), dtype=self.dtype, device=self.device)
        encoder = tensors.get("encoder")
        both = torch.cat([t for t in (encoder, decoder) if t is not None])
        return PromptPrefix(prefix_id, decoder, _key(prefix_id, both), encoder)

    def _check(self, tensor: Any, source: str) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise PrefixError(f"{source} holds a {type(tensor).__name__}, not a tensor")
        if tensor.ndim != 2:
            raise PrefixError(
                f"{source} has {tensor.ndim} dimensions; a prefix is [virtual tokens, hidden size]"
            )
        rows, width = tensor.shape
        if width != self.hidden_size:
            raise PrefixError(
                f"{source} is {width} wide; this model's hidden size is {self.hidden_size}"
            )
        if rows == 0 or rows > self.max_length:
            raise PrefixError(
                f"{source} has {rows} virtual tokens; a prefix has 1 to {self.max_length}"
            )
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise PrefixError(f"{source} has values that are not finite numbers")
        converted = tensor.to(dtype=self.dtype, device=self.device).contiguous()
        if not torch.isfinite(converted).all():
            raise PrefixError(f"{source} has values beyond the range of {self.dtype}")
        return converted


def _size(prefix: PromptPrefix) -> int:
    parts = (prefix.embeddings, prefix.encoder)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _key(prefix_id: str, embeddings: torch.Tensor) -> bytes:
    """The prefix-cache salt of a prefix: its id and a digest of its values."""
    digest = hashlib.sha256(embeddings.float().cpu().numpy().tobytes()).digest()[:16]
    return b"prefix:" + prefix_id.encode() + digest


def _peft_prompt(path: Path) -> torch.Tensor:
    """PEFT's saved prompt-tuning embeddings [num_virtual_tokens, token_dim]."""
    config = read_config(path, "PROMPT_TUNING", "a prefix")
    name, state = read_weights(path)
    if PEFT_TENSOR not in state:
        raise PrefixError(f"{name} has no {PEFT_TENSOR!r} tensor")
    tensor = state[PEFT_TENSOR]
    expected = config.get("num_virtual_tokens")
    if isinstance(tensor, torch.Tensor) and expected and tensor.shape[0] != expected:
        raise PrefixError(
            f"{PEFT_TENSOR} has {tensor.shape[0]} rows; the adapter says num_virtual_tokens "
            f"{expected}"
        )
    return tensor


__all__ = ["DEFAULT_CACHE_BYTES", "PrefixError", "PrefixStore"]
