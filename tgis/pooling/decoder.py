"""A decoder pooling model's forward on the paged engine's layers: a batch's rows back to back
(no padding), attended causally within each row, and no KV cache at all.

Decoder embedders (Qwen3-Embedding style: a causal LM's hidden states, last-token pooled) and
decoder rerankers that score a yes/no token (Qwen3-Reranker style) run the same decoder as
generation, `DecoderWeights` (models/decoder.py): its fused projections, rope tables and every
family's traits. Nothing outlives the request: no pool is allocated, each layer's keys and
values are attended to where they were computed, and the batch's memory goes back when its
forward returns.

Attention per row is SDPA (causal, the layer's sliding window and soft-capping as the paged
engine applies them, `paged.attention.sdpa`); on CUDA in half precision, where the installed
torch's `varlen_attn` takes a window and grouped heads, the whole packed batch is one flash
attention call instead (`packed_attention_path`).

A yes/no reranker scores a row by its last token's logits of two tokens: the lm_head keeps only
their rows, and the score is logit(yes) - logit(no), whose sigmoid is the probability of "yes"
against "no" (what the model card's softmax over the two gives).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from tgis.backends.common.gemm import linear
from tgis.backends.common.masks import causal_mask
from tgis.backends.models.decoder import DecoderWeights, LayerWeights
from tgis.backends.paged.attention import FLASH_DTYPES, sdpa, varlen_parameters

# varlen_attn's arguments this forward passes besides the tensors.
_VARLEN_NEEDS = frozenset({"scale", "window_size", "enable_gqa"})


def packed_attention_path(
    device: torch.device, dtype: torch.dtype, softcap: float | None, parameters: frozenset[str]
) -> str:
    """ "varlen" (one flash attention call over the packed batch) on CUDA in float16 or
    bfloat16 where `parameters` (varlen_attn's) has what it needs and scores are not
    soft-capped; else "sdpa" (one call per row)."""
    if (
        device.type == "cuda"
        and dtype in FLASH_DTYPES
        and softcap is None
        and parameters >= _VARLEN_NEEDS
    ):
        return "varlen"
    return "sdpa"


class PackedRows:
    """A batch of token-id rows back to back on `device`: the ids, each token's position in
    its row, the rows' spans and cumulative lengths, and per sliding window the masks of the
    rows a causal mask alone does not cover."""

    def __init__(
        self, rows: Sequence[Sequence[int]], device: torch.device, windows: Sequence[int | None]
    ) -> None:
        lengths = [len(row) for row in rows]
        if not lengths or min(lengths) < 1:
            raise ValueError("every row needs at least one token")
        self.lengths = lengths
        self.ids = torch.tensor([t for row in rows for t in row], dtype=torch.long, device=device)
        self.positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        ends = torch.tensor(lengths).cumsum(0)
        self.cu = torch.nn.functional.pad(ends, (1, 0)).to(device=device, dtype=torch.int32)
        self.spans = [(int(e) - n, int(e)) for e, n in zip(ends, lengths, strict=True)]
        # Per window: each row's boolean mask [1, 1, n, n], None where causal is all it needs.
        self.masks: dict[int | None, list[torch.Tensor | None]] = {
            w: [
                None
                if w is None or n <= w
                else causal_mask(torch.arange(n, device=device)[None], n, w)
                for n in lengths
            ]
            for w in set(windows)
        }

    @property
    def last(self) -> torch.Tensor:
        """Each row's last token's index in the packed tokens [rows]."""
        return self.cu[1:].long() - 1


class PackedDecoder:
    """A decoder's forward over `PackedRows`, returning the final norm's hidden states
    (`hidden`), a yes/no reranker's scores or a sequence classifier's logits (`scores`)."""

    @torch.inference_mode()
    def __init__(
        self,
        model: PreTrainedModel,
        max_positions: int,
        score_ids: tuple[int, int] | None = None,
    ) -> None:
        """`model`: a causal LM, or a `*ForSequenceClassification` decoder (its weights move
        into the lean layouts); `score_ids`: the (yes, no) token ids a causal LM reranks with
        (None: an embedder, no lm_head kept)."""
        device = next(model.parameters()).device
        self.weights = DecoderWeights(model, device, max_positions)
        self.device = device
        self.dtype = self.weights.dtype
        self.score_ids = score_ids
        # A classifier scores the last token that is not padding, as transformers does.
        self.classifier = model.get_output_embeddings() is None
        self.pad_id = model.config.pad_token_id if self.classifier else None
        head = self.weights.lm_head
        assert isinstance(head, torch.Tensor)
        if not self.classifier:
            # Only the two scored tokens' rows of the lm_head are read; the rest is let go.
            self.weights.lm_head = head[list(score_ids)].clone() if score_ids else head[:0]
        self.path = packed_attention_path(
            device, self.dtype, self.weights.attn_softcap, varlen_parameters()
        )

    @torch.inference_mode()
    def hidden(self, rows: PackedRows) -> torch.Tensor:
        """Every token's last hidden state (after the final norm) [tokens, hidden]."""
        return self.weights.normed(self._layers(rows))

    @torch.inference_mode()
    def scores(self, rows: PackedRows) -> torch.Tensor:
        """Each row's scores (float32): a classifier's logits [rows, labels] at its last
        token that is not the pad token (transformers' `score` over the final norm, unscaled),
        or a yes/no reranker's [rows, 1], its last token's logit of "yes" less that of "no",
        as the family scales and caps its logits."""
        if self.classifier:
            w = self.weights
            picked = self._layers(rows)[self._classified(rows)]
            return linear(w.normed(picked), w.lm_head).float()
        if self.score_ids is None:
            raise ValueError("this decoder embeds; it scores no tokens")
        logits = self.weights.logits(self._layers(rows)[rows.last])
        return (logits[:, 0] - logits[:, 1]).unsqueeze(1)

    def _classified(self, rows: PackedRows) -> torch.Tensor:
        """Each row's index of its last token that is not the pad token (its last token where
        there is none, or the model names no pad token)."""
        if self.pad_id is None:
            return rows.last
        device = rows.ids.device
        index = torch.arange(rows.ids.shape[0], device=device)
        real = torch.where(rows.ids != self.pad_id, index, -1)
        row_of = torch.repeat_interleave(
            torch.arange(len(rows.lengths), device=device),
            torch.tensor(rows.lengths, device=device),
        )
        found = torch.full((len(rows.lengths),), -1, device=device, dtype=index.dtype)
        found = found.scatter_reduce(0, row_of, real, "amax")
        return torch.where(found >= 0, found, rows.last)

    def _layers(self, rows: PackedRows) -> torch.Tensor:
        """The last layer's output [tokens, hidden], before the final norm."""
        w = self.weights

        def attention(
            index: int, layer: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            if self.path == "varlen":
                return _varlen(q, k, v, rows, w.scaling, layer.window)
            out = torch.empty_like(q)
            for (start, end), mask in zip(rows.spans, rows.masks[layer.window], strict=True):
                span = slice(start, end)
                out[span] = sdpa(
                    q[span].transpose(0, 1)[None],
                    k[span].transpose(0, 1)[None],
                    v[span].transpose(0, 1)[None],
                    mask,
                    w.scaling,
                    w.attn_softcap,
                )[0].transpose(0, 1)
            return out

        return w.layers_over(w.embedded(rows.ids), rows.positions, attention)


def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: PackedRows,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Causal flash attention over the packed rows in one call (`varlen_attn` without pages)."""
    from torch.nn.attention.varlen import varlen_attn

    longest = max(rows.lengths)
    left = -1 if window is None else window - 1  # keys left of the query's own position
    return varlen_attn(  # type: ignore[return-value]
        q,
        k,
        v,
        rows.cu,
        rows.cu,
        longest,
        longest,
        scale=scale,
        window_size=(left, 0),
        enable_gqa=q.shape[1] != k.shape[1],
    )
