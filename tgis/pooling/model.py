"""A pooling model's forward over a batch: right-padded rows, the hidden states pooled per row
as its spec says (tgis.pooling.spec), or a classifier's logits.

The pooling follows sentence-transformers' Pooling module and `finish_embedding` its Normalize,
so that an embedding equals `SentenceTransformer.encode`'s for the same model and input (the
APIs normalize as the model's pipeline does, or as TEI's `normalize` asks); a score is the
`*ForSequenceClassification` model's logits, as TEI's `raw_scores` and a cross-encoder's
`predict` without its activation give them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tgis.pooling.spec import PoolingSpec

# One tokenized input: the tokenizer's outputs for it (input_ids, and token_type_ids where the
# tokenizer gives them), unpadded.
Encoded = Mapping[str, Sequence[int]]


@dataclass(frozen=True)
class PooledBatch:
    """Each row's output: an embedding (float32, 1-D) or a classifier's logits (1-D)."""

    rows: list[torch.Tensor]


class PoolingModel:
    """A loaded pooling model and its tokenizer; `run` takes a batch of encoded inputs."""

    def __init__(self, model: Any, tokenizer: Any, spec: PoolingSpec) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = spec
        self.device = next(model.parameters()).device
        positions = getattr(model.config, "max_position_embeddings", None)
        limits = [n for n in (spec.max_length, positions) if n]
        # The longest input, in tokens (sentence-transformers' max_seq_length first).
        self.max_length = min(limits) if limits else None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._left: Any = None

    @classmethod
    def load(
        cls,
        model_dir: Path,
        spec: PoolingSpec,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> PoolingModel:
        """The model in `model_dir` for `spec`'s task, on `device` in `dtype` (its own when
        None), with its tokenizer."""
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        kind = AutoModel if spec.task == "embed" else AutoModelForSequenceClassification
        model = kind.from_pretrained(model_dir, dtype=dtype or "auto").to(device)
        return cls(model, AutoTokenizer.from_pretrained(model_dir), spec)

    @property
    def dimension(self) -> int:
        """An embedding's size (all its modes concatenated) or a classifier's label count."""
        if self.spec.task != "embed":
            return len(self.spec.labels)
        return int(self.model.config.hidden_size) * len(self.spec.modes)

    def encode(
        self, text: str | tuple[str, str], truncate: bool = False, left: bool = False
    ) -> dict[str, list[int]]:
        """`text` (or a query-document pair) as the model's tokenizer encodes it; cut to
        `max_length` when `truncate`: its end (of the longer of a pair), or its start when
        `left`, the tokenizer's special tokens kept."""
        first, second = (text, None) if isinstance(text, str) else text
        tokenizer = self._left_tokenizer() if left else self.tokenizer
        encoded = tokenizer(
            first,
            second,
            truncation="longest_first" if truncate and self.max_length else False,
            max_length=self.max_length if truncate else None,
        )
        return {
            name: list(encoded[name]) for name in ("input_ids", "token_type_ids") if name in encoded
        }

    def cut_ids(self, ids: Sequence[int], left: bool = False) -> dict[str, list[int]]:
        """Token ids given as an input, cut to `max_length` (their end, or start when `left`)."""
        keep = list(ids)
        if self.max_length is not None and len(keep) > self.max_length:
            keep = keep[-self.max_length :] if left else keep[: self.max_length]
        return {"input_ids": keep}

    def _left_tokenizer(self) -> Any:
        """A copy of the tokenizer that truncates from the start (made once)."""
        if self._left is None:
            left = copy.deepcopy(self.tokenizer)
            left.truncation_side = "left"
            self._left = left
        return self._left

    @torch.inference_mode()
    def run(self, batch: Sequence[Encoded], tokens: bool = False) -> PooledBatch:
        """Each input's pooled output, in the order given (one forward, rows right-padded);
        with `tokens`, each input's hidden state per token instead ([its tokens, hidden]:
        sentence-transformers' `token_embeddings`, TEI's /embed_all)."""
        inputs = self._padded(batch)
        if self.spec.task != "embed":
            if tokens:
                raise ValueError(f"a {self.spec.task} model has no token embeddings")
            logits = self.model(**inputs).logits
            return PooledBatch(list(logits.float().cpu().unbind(0)))
        hidden = self.model(**inputs).last_hidden_state
        if tokens:
            rows = hidden.float().cpu()
            return PooledBatch([rows[i, : len(row["input_ids"])] for i, row in enumerate(batch)])
        pooled = pool(hidden, inputs["attention_mask"], self.spec.modes)
        return PooledBatch(list(pooled.float().cpu().unbind(0)))

    def _padded(self, batch: Sequence[Encoded]) -> dict[str, torch.Tensor]:
        width = max(len(row["input_ids"]) for row in batch)
        names = [name for name in ("input_ids", "token_type_ids") if name in batch[0]]
        out = {name: torch.zeros(len(batch), width, dtype=torch.long) for name in names}
        out["input_ids"].fill_(self.pad_id)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, row in enumerate(batch):
            n = len(row["input_ids"])
            for name in names:
                out[name][i, :n] = torch.tensor(row[name], dtype=torch.long)
            mask[i, :n] = 1
        out["attention_mask"] = mask
        return {name: tensor.to(self.device) for name, tensor in out.items()}


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """[rows, tokens, hidden] states of right-padded rows ([rows, tokens] mask) pooled by each
    mode, concatenated in order, as sentence-transformers' Pooling module does."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    counts = weights.sum(1).clamp(min=1e-9)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "max":
            masked = hidden.masked_fill(weights == 0, -1e9)
            parts.append(masked.max(1).values)
        elif mode == "mean":
            parts.append((hidden * weights).sum(1) / counts)
        elif mode == "mean_sqrt_len":
            parts.append((hidden * weights).sum(1) / counts.sqrt())
        elif mode == "weightedmean":
            steps = torch.arange(1, hidden.shape[1] + 1, device=hidden.device)
            ramp = weights * steps.view(1, -1, 1).to(hidden.dtype)
            parts.append((hidden * ramp).sum(1) / ramp.sum(1).clamp(min=1e-9))
        elif mode == "lasttoken":
            last = mask.sum(1) - 1
            parts.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return torch.cat(parts, dim=1)


def finish_embedding(vector: torch.Tensor, size: int | None, normalize: bool) -> torch.Tensor:
    """A pooled row as the API returns it: cut to its first `size` values (a Matryoshka size;
    None: whole), then L2-normalized when `normalize` (the model's Normalize module, or the
    request's choice where the API gives one)."""
    if size is not None and size < vector.shape[0]:
        vector = vector[:size]
    return torch.nn.functional.normalize(vector, p=2, dim=0) if normalize else vector
