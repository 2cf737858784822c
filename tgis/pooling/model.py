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

from tgis.errors import ConfigError, InputValidationError
from tgis.pooling.decoder import PackedDecoder, PackedRows
from tgis.pooling.spec import PoolingSpec, compile_template

# One tokenized input: the tokenizer's outputs for it (input_ids, and token_type_ids where the
# tokenizer gives them), unpadded.
Encoded = Mapping[str, Sequence[int]]


@dataclass(frozen=True)
class PooledBatch:
    """Each row's output: an embedding (float32, 1-D) or a classifier's logits (1-D)."""

    rows: list[torch.Tensor]


class EncoderForward:
    """transformers' model over right-padded rows: an encoder (or a `*ForSequenceClassification`
    model) as its own forward runs it."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model = model.eval()
        self.pad_id = pad_id
        self.device = next(model.parameters()).device

    def hidden(self, batch: Sequence[Encoded]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last hidden states [rows, width, hidden] and the mask of real tokens [rows,
        width]."""
        inputs = self._padded(batch)
        return self.model(**inputs).last_hidden_state, inputs["attention_mask"]

    def scores(self, batch: Sequence[Encoded]) -> torch.Tensor:
        """The classifier's logits [rows, labels]."""
        return self.model(**self._padded(batch)).logits

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


class DecoderForward:
    """A decoder on the paged engine's layers over packed rows (tgis.pooling.decoder), its
    hidden states laid out as `EncoderForward`'s for pooling."""

    def __init__(self, decoder: PackedDecoder) -> None:
        self.decoder = decoder

    def hidden(self, batch: Sequence[Encoded]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows(batch)
        packed = self.decoder.hidden(rows)
        lengths = torch.tensor(rows.lengths, device=packed.device)
        mask = torch.arange(int(lengths.max()), device=packed.device)[None] < lengths[:, None]
        padded = packed.new_zeros(len(batch), mask.shape[1], packed.shape[1])
        padded[mask] = packed  # row-major: each row's tokens in order
        return padded, mask.long()

    def scores(self, batch: Sequence[Encoded]) -> torch.Tensor:
        return self.decoder.scores(self._rows(batch))

    def _rows(self, batch: Sequence[Encoded]) -> PackedRows:
        windows = [layer.window for layer in self.decoder.weights.layers]
        return PackedRows([row["input_ids"] for row in batch], self.decoder.device, windows)


Forward = EncoderForward | DecoderForward


class PoolingModel:
    """A loaded pooling model and its tokenizer; `run` takes a batch of encoded inputs."""

    def __init__(self, forward: Forward, tokenizer: Any, spec: PoolingSpec, config: Any) -> None:
        """`config`: the model's transformers config."""
        self.forward = forward
        self.tokenizer = tokenizer
        self.spec = spec
        self.config = config
        self.max_length = longest_input(spec, config)
        self._left: Any = None
        self._template = compile_template(spec.template) if spec.template else None

    @classmethod
    def load(
        cls,
        model_dir: Path,
        spec: PoolingSpec,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> PoolingModel:
        """The model in `model_dir` for `spec`'s task, on `device` in `dtype` (its own when
        None), with its tokenizer: a decoder on the paged engine's layers where the spec
        says it runs there (`PoolingSpec.decoder`), else transformers' own model."""
        from transformers import (
            AutoConfig,
            AutoModel,
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        chosen: Any = dtype or "auto"
        forward: Forward
        if spec.decoder:
            score_ids = score_token_ids(tokenizer, spec.score_tokens) if spec.score_tokens else None
            if spec.task != "embed" and not score_ids:  # a decoder's *ForSequenceClassification
                model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=chosen)
            else:
                # An embedder reads no logits: a tied head is the embeddings, never a new one.
                tie = {} if score_ids else {"tie_word_embeddings": True}
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=chosen, **tie)
            limit = longest_input(spec, config)
            assert limit is not None  # a decoder the paged layers run has its positions
            forward = DecoderForward(PackedDecoder(model.to(device).eval(), limit, score_ids))
        else:
            kind = AutoModel if spec.task == "embed" else AutoModelForSequenceClassification
            model = kind.from_pretrained(model_dir, dtype=chosen).to(device)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            forward = EncoderForward(model, pad)
        return cls(forward, tokenizer, spec, config)

    @property
    def packed(self) -> bool:
        """Whether a batch runs its rows back to back (a decoder on the paged layers: its cost
        is its tokens) rather than right-padded to its longest (its rows x its longest)."""
        return isinstance(self.forward, DecoderForward)

    @property
    def dimension(self) -> int:
        """An embedding's size (all its modes concatenated) or a classifier's label count."""
        if self.spec.task != "embed":
            return len(self.spec.labels)
        return int(self.config.hidden_size) * len(self.spec.modes)

    def prompt(self, name: str | None) -> str | None:
        """The text of the model's prompt `name` (sentence-transformers' named prompts); None
        names the model's default prompt, if it has one. An InputValidationError lists the
        names for one the model does not have."""
        prompts = dict(self.spec.prompts)
        if name is None:
            return prompts.get(self.spec.default_prompt) if self.spec.default_prompt else None
        if name not in prompts:
            names = ", ".join(repr(n) for n in prompts)
            raise InputValidationError(
                f"`prompt_name` {name!r} is not one of this model's prompts"
                + (f" ({names})" if names else ": it has none")
            )
        return prompts[name]

    def encode(
        self,
        text: str | tuple[str, str],
        truncate: bool = False,
        left: bool = False,
        prompt: str | None = None,
    ) -> dict[str, list[int]]:
        """`text` (or a query-document pair) as the model's tokenizer encodes it; cut to
        `max_length` when `truncate`: its end (of the longer of a pair), or its start when
        `left`, the tokenizer's special tokens kept. A pair under a reranker's template is
        the template's text, its document cut where it is too long. `prompt`: a text put
        before `text`; where the model pools without its prompt, `skip` holds how many of
        the first tokens pooling leaves out (as sentence-transformers counts them)."""
        if self._template is not None and not isinstance(text, str):
            return {"input_ids": self._templated(*text, truncate, left)}
        if prompt is not None and isinstance(text, str):
            encoded = self.encode(prompt + text, truncate, left)
            if not self.spec.include_prompt:
                encoded["skip"] = [self._prompt_length(prompt)]
            return encoded
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

    def _prompt_length(self, prompt: str) -> int:
        """The prompt's tokens as sentence-transformers counts them: the prompt encoded alone
        (stripped, as its Transformer module strips every text), less a special token it ends
        with."""
        ids = list(self.tokenizer(prompt.strip())["input_ids"])
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        return len(ids) - 1 if ids and ids[-1] in special else len(ids)

    def _templated(self, query: str, document: str, truncate: bool, left: bool) -> list[int]:
        """The template's text for (query, document) as token ids. With `truncate`, one too
        long keeps the template's text before and after the document whole and cuts the
        document's tokens (its end, or its start when `left`) to fit, each piece tokenized
        alone (as Qwen3-Reranker's model card builds its inputs)."""
        assert self._template is not None

        def ids_of(text: str) -> list[int]:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        ids = ids_of(self._template.render(query=query, document=document))
        if not truncate or self.max_length is None or len(ids) <= self.max_length:
            return ids
        marker = "\x00document\x00"
        pieces = self._template.render(query=query, document=marker).split(marker)
        if len(pieces) != 2:  # the document placed more than once: cut the whole
            return ids[-self.max_length :] if left else ids[: self.max_length]
        before, after = ids_of(pieces[0]), ids_of(pieces[1])
        room = max(0, self.max_length - len(before) - len(after))
        words = ids_of(document)
        kept = (words[len(words) - room :] if room else []) if left else words[:room]
        return (before + kept + after)[: self.max_length]

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
        """Each input's pooled output, in the order given (one forward); with `tokens`, each
        input's hidden state per token instead ([its tokens, hidden]: sentence-transformers'
        `token_embeddings`, TEI's /embed_all)."""
        if self.spec.task != "embed":
            if tokens:
                raise ValueError(f"a {self.spec.task} model has no token embeddings")
            return PooledBatch(list(self.forward.scores(batch).float().cpu().unbind(0)))
        hidden, mask = self.forward.hidden(batch)
        skips = [int(row["skip"][0]) if "skip" in row else 0 for row in batch]
        if any(skips) and not tokens:  # prompts pooled without their tokens
            mask = mask.clone()
            for i, skip in enumerate(skips):
                mask[i, :skip] = 0
        if tokens:
            rows = hidden.float().cpu()
            return PooledBatch([rows[i, : len(row["input_ids"])] for i, row in enumerate(batch)])
        pooled = pool(hidden, mask, self.spec.modes)
        return PooledBatch(list(pooled.float().cpu().unbind(0)))


def longest_input(spec: PoolingSpec, config: Any) -> int | None:
    """The longest input in tokens: sentence-transformers' max_seq_length or the model's
    positions, the smaller (None: neither is known)."""
    positions = getattr(config, "max_position_embeddings", None)
    limits = [n for n in (spec.max_length, positions) if n]
    return min(limits) if limits else None


def score_token_ids(tokenizer: Any, tokens: Sequence[str]) -> tuple[int, int]:
    """The ids of a yes/no reranker's two tokens (--rerank-tokens); a ConfigError for one the
    tokenizer does not hold as a single token."""
    ids = []
    for token in tokens:
        encoded = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ConfigError(
                f"--rerank-tokens {','.join(tokens)}: {token!r} is {len(encoded)} tokens to "
                "this model's tokenizer, not one",
                "name the two tokens the model answers with, as its model card does "
                "(Qwen3-Reranker: yes,no)",
            )
        ids.append(int(encoded[0]))
    return ids[0], ids[1]


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
        elif mode == "lasttoken":  # the last token the mask holds
            last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
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
