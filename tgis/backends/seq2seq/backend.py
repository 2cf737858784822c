"""Encoder-decoder models (T5, mT5, flan-T5, flan-UL2, BART) on cpu and cuda, in the engine's
continuous batch.

A sequence's prefill runs the model's own encoder once over its input and keeps, per decoder
layer, the cross-attention keys and values of the encoder's output in the sequence's slot;
then the decoder takes its start token. Each decode step runs the decoder over one token per
running sequence, whatever their input and output lengths: every row attends its own slot's
self-attention cache up to its own position (T5's relative position bias and BART's learned
positions are taken per row) and its own encoder states up to its input's length, so
sequences join and leave between steps as decoder-only ones do.

The decoder is written here over the model's own modules and weights (`T5Decoder`,
`BartDecoder`): transformers' decoder forward takes one position for the whole batch, which
a continuous batch does not have. Greedy tokens equal `model.generate`'s (tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from tgis.backends.common.device import load_causal_lm
from tgis.engine.backend import (
    BackendCapacity,
    PrefillItem,
    PrefillOutput,
    Shape,
    ShapeTiming,
    check_prefill_items,
)
from tgis.errors import ConfigError

log = logging.getLogger("tgis.backends.seq2seq.backend")

SUPPORTED = ("t5", "mt5", "bart")


@dataclass
class CrossStates:
    """Per layer the encoder output's keys and values, [heads, input length, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class Attend:
    """The step's caches, seen by a decoder layer: write this step's self-attention keys and
    values, read every row's keys/values with the masks of its own lengths."""

    self_keys: list[torch.Tensor]  # per layer [slots, heads, max_output, head_dim]
    self_values: list[torch.Tensor]
    cross_keys: list[torch.Tensor]  # per layer [slots, heads, max_input, head_dim]
    cross_values: list[torch.Tensor]
    slots: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    self_len: int  # max(positions) + 1
    cross_len: int  # the longest input among the rows
    self_mask: torch.Tensor  # [rows, 1, self_len] additive
    cross_mask: torch.Tensor  # [rows, 1, cross_len] additive

    def self_attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q/k/v [rows, heads, head_dim] -> [rows, heads * head_dim]."""
        self.self_keys[layer][self.slots, :, self.positions] = k
        self.self_values[layer][self.slots, :, self.positions] = v
        keys = self.self_keys[layer][self.slots, :, : self.self_len]
        values = self.self_values[layer][self.slots, :, : self.self_len]
        mask = self.self_mask if bias is None else self.self_mask + bias
        return _attention(q, keys, values, scale, mask)

    def cross_attention(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        keys = self.cross_keys[layer][self.slots, :, : self.cross_len]
        values = self.cross_values[layer][self.slots, :, : self.cross_len]
        return _attention(q, keys, values, scale, self.cross_mask)


def _attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor
) -> torch.Tensor:
    """q [rows, heads, d], keys/values [rows, heads, len, d], additive mask [rows, 1|heads, len]."""
    scores = torch.einsum("bhd,bhld->bhl", q, keys) * scale + mask
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    return torch.einsum("bhl,bhld->bhd", probs, values).reshape(q.shape[0], -1)


class Decoder:
    """One family's decoder over the backend's caches (subclasses: `step` and the modules
    that project encoder states to cross-attention keys and values)."""

    def __init__(self, model: PreTrainedModel, num_layers: int, num_heads: int, head_dim: int):
        self.model = model
        self.decoder = model.get_decoder()
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim

    def embed_input(self, ids: torch.Tensor) -> torch.Tensor:
        """The encoder's input embeddings of token ids, as its forward computes them."""
        return self.model.get_encoder().embed_tokens(ids)

    def cross_projections(self) -> list[tuple[nn.Module, nn.Module]]:
        """Per decoder layer, the key and value projections of its cross-attention."""
        raise NotImplementedError

    def cross_states(self, encoded: torch.Tensor) -> CrossStates:
        """Cross-attention keys/values of one input's encoder output [length, d_model]."""
        keys, values = [], []
        for key, value in self.cross_projections():
            keys.append(self._heads(key(encoded)))
            values.append(self._heads(value(encoded)))
        return CrossStates(keys, values)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[length, heads * head_dim] -> [heads, length, head_dim]."""
        return x.view(x.shape[0], self.num_heads, self.head_dim).transpose(0, 1)

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [rows, vocab] (float32) of one decoder token per row at `positions`;
        `embeds` [rows, d_model] replaces the tokens' embeddings (a prompt prefix)."""
        raise NotImplementedError


class T5Decoder(Decoder):
    """T5 / mT5 / flan-T5 / flan-UL2: pre-norm RMS layers, unscaled attention, a relative
    position bias from the first layer shared by all, gated or plain feed-forward."""

    def __init__(self, model: PreTrainedModel) -> None:
        first = model.get_decoder().block[0].layer[0].SelfAttention
        super().__init__(
            model, len(model.get_decoder().block), first.n_heads, first.key_value_proj_dim
        )
        self.config = model.config
        self.bias_table = first.relative_attention_bias
        self.bucket = first._relative_position_bucket

    def cross_projections(self) -> list[tuple[nn.Module, nn.Module]]:
        return [
            (b.layer[1].EncDecAttention.k, b.layer[1].EncDecAttention.v) for b in self.decoder.block
        ]

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, heads, dim = tokens.shape[0], self.num_heads, self.head_dim
        # Relative position of every cached key to the row's own query: [rows, self_len].
        relative = torch.arange(attend.self_len, device=tokens.device)[None] - positions[:, None]
        buckets = self.bucket(
            relative,
            bidirectional=False,
            num_buckets=self.config.relative_attention_num_buckets,
            max_distance=self.config.relative_attention_max_distance,
        )
        bias = self.bias_table(buckets).permute(0, 2, 1)  # [rows, heads, self_len]
        x = self.decoder.embed_tokens(tokens) if embeds is None else embeds  # [rows, d_model]
        for index, block in enumerate(self.decoder.block):
            sa = block.layer[0]
            h = sa.layer_norm(x)
            q, k, v = (
                m(h).view(rows, heads, dim)
                for m in (sa.SelfAttention.q, sa.SelfAttention.k, sa.SelfAttention.v)
            )
            x = x + sa.SelfAttention.o(attend.self_attention(index, q, k, v, 1.0, bias))
            ca = block.layer[1]
            q = ca.EncDecAttention.q(ca.layer_norm(x)).view(rows, heads, dim)
            x = x + ca.EncDecAttention.o(attend.cross_attention(index, q, 1.0))
            x = block.layer[2](x)  # T5LayerFF: x + feed_forward(layer_norm(x))
        x = self.decoder.final_layer_norm(x)
        if self.config.tie_word_embeddings:
            x = x * (self.config.d_model**-0.5)
        return self.model.lm_head(x).float()


class BartDecoder(Decoder):
    """BART: post-norm layers, scaled attention with biases, learned positions (offset 2)
    after scaled token embeddings, a final logits bias."""

    def __init__(self, model: PreTrainedModel) -> None:
        attn = model.get_decoder().layers[0].self_attn
        super().__init__(model, len(model.get_decoder().layers), attn.num_heads, attn.head_dim)
        self.scale = attn.scaling

    def cross_projections(self) -> list[tuple[nn.Module, nn.Module]]:
        return [
            (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj) for layer in self.decoder.layers
        ]

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, heads, dim = tokens.shape[0], self.num_heads, self.head_dim
        d = self.decoder
        x = d.embed_tokens(tokens) if embeds is None else embeds
        x = x + d.embed_positions.weight[positions + d.embed_positions.offset]
        x = d.layernorm_embedding(x)
        for index, layer in enumerate(d.layers):
            sa = layer.self_attn
            q, k, v = (m(x).view(rows, heads, dim) for m in (sa.q_proj, sa.k_proj, sa.v_proj))
            x = layer.self_attn_layer_norm(
                x + sa.out_proj(attend.self_attention(index, q, k, v, self.scale))
            )
            ca = layer.encoder_attn
            q = ca.q_proj(x).view(rows, heads, dim)
            x = layer.encoder_attn_layer_norm(
                x + ca.out_proj(attend.cross_attention(index, q, self.scale))
            )
            x = layer.final_layer_norm(x + layer.fc2(layer.activation_fn(layer.fc1(x))))
        logits = self.model.lm_head(x) + self.model.final_logits_bias
        return logits.float()


def decoder_for(model: PreTrainedModel) -> Decoder:
    kind = model.config.model_type
    if kind in ("t5", "mt5"):
        return T5Decoder(model)
    if kind == "bart":
        return BartDecoder(model)
    raise ConfigError(
        f"encoder-decoder model type {kind!r} is not served",
        f"serve one of {', '.join(SUPPORTED)} (T5, mT5, flan-T5, flan-UL2, BART)",
    )


class Seq2SeqBackend:
    """The slot `Backend` of encoder-decoder models: `max_sequences` slots, each holding its
    input's encoder states (as cross keys/values) and its output's self-attention cache, both
    up to `max_sequence_tokens`."""

    name = "seq2seq"

    def __init__(
        self, model: PreTrainedModel, max_sequences: int, max_sequence_tokens: int
    ) -> None:
        self.model = model.eval()
        self.decoder = decoder_for(model)
        config = model.config
        self.device_obj = next(model.parameters()).device
        self.device = str(self.device_obj)
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.start_token = config.decoder_start_token_id
        if self.start_token is None:
            raise ConfigError(
                f"{config.model_type} has no decoder_start_token_id in its config",
                "set decoder_start_token_id in config.json",
            )
        self.max_tokens = max_sequence_tokens
        dec = self.decoder
        shape = (max_sequences, dec.num_heads, max_sequence_tokens, dec.head_dim)

        def caches() -> list[torch.Tensor]:
            return [
                torch.zeros(shape, dtype=self.dtype, device=self.device_obj)
                for _ in range(dec.num_layers)
            ]

        self.self_keys, self.self_values = caches(), caches()
        self.cross_keys, self.cross_values = caches(), caches()
        per_token = 4 * dec.num_layers * dec.num_heads * dec.head_dim * self.dtype.itemsize
        self._capacity = BackendCapacity(
            max_sequences=max_sequences,
            max_sequence_tokens=max_sequence_tokens,
            kv_tokens=max_sequences * max_sequence_tokens,
            kv_bytes_per_token=per_token,
            # Input-token details are the decoder-only models' (as in TGIS).
            prompt_logprobs=False,
            encoder_decoder=True,
        )
        self._slot_of: dict[int, int] = {}
        self._free = list(range(max_sequences))
        # Per slot, on the host: a step's masks are built from them without reading the device.
        self._input_len = [0] * max_sequences
        self._output_len = [0] * max_sequences

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: str = "cpu",
        dtype: str | None = None,
        *,
        max_sequences: int,
        max_sequence_tokens: int,
        num_threads: int | None = None,
    ) -> Seq2SeqBackend:
        model = load_causal_lm(model_dir, torch.device(device), dtype, num_threads, seq2seq=True)
        return cls(model, max_sequences, max_sequence_tokens)

    @property
    def capacity(self) -> BackendCapacity:
        return self._capacity

    # --- steps -------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, items: Sequence[PrefillItem]) -> PrefillOutput:
        """Encode the inputs, keep their cross keys/values, run the decoder's start token."""
        if not items:
            return PrefillOutput(torch.empty((0, self.vocab_size), device=self.device_obj), ())
        check_prefill_items(
            items, free=len(self._free), slots=f"{self._capacity.max_sequences} slots",
            running=self._slot_of, max_prompt=self.max_tokens,
            max_prompt_label="max_sequence_tokens", vocab_size=self.vocab_size,
        )  # fmt: skip
        for item in items:
            encoder_rows = _rows(item.encoder_embeds) + len(item.input_ids)
            if encoder_rows > self.max_tokens or _rows(item.embeds) >= self.max_tokens:
                raise ValueError(
                    f"sequence {item.seq_id}: its prompt prefix and input exceed "
                    f"max_sequence_tokens ({self.max_tokens})"
                )
        slots = self._free[: len(items)]
        encoded = self._encode(items)
        for slot, states in zip(slots, encoded, strict=True):
            cross = self.decoder.cross_states(states)
            length = states.shape[0]
            for layer in range(self.decoder.num_layers):
                self.cross_keys[layer][slot, :, :length] = cross.keys[layer]
                self.cross_values[layer][slot, :, :length] = cross.values[layer]
            self._input_len[slot] = length
        # A decoder prefix's virtual tokens go first, one position a step (rows without one,
        # or with a shorter one, wait), then every row's start token.
        longest = max(_rows(item.embeds) for item in items)
        for position in range(longest):
            rows = [i for i, item in enumerate(items) if _rows(item.embeds) > position]
            embeds = torch.stack([items[i].embeds[position] for i in rows])  # type: ignore[index]
            self._step([slots[i] for i in rows], [self.start_token] * len(rows), embeds)
        logits = self._step(slots, [self.start_token] * len(items))
        # Only now do the sequences exist: a failed forward leaves no half-registered state.
        for slot, item in zip(slots, items, strict=True):
            self._slot_of[item.seq_id] = slot
            self._free.remove(slot)
        return PrefillOutput(logits, (None,) * len(items))

    def _encode(self, items: Sequence[PrefillItem]) -> list[torch.Tensor]:
        """The encoder's output [length, d_model] of each input, after its prompt prefix's
        encoder embeddings if it has some (one padded batch)."""
        device = self.device_obj
        embedded = []
        for item in items:
            tokens = self.decoder.embed_input(torch.tensor(list(item.input_ids), device=device))
            if item.encoder_embeds is not None:
                tokens = torch.cat([item.encoder_embeds.to(tokens.dtype), tokens])
            embedded.append(tokens)
        width = max(e.shape[0] for e in embedded)
        batch = embedded[0].new_zeros((len(items), width, embedded[0].shape[1]))
        mask = torch.zeros((len(items), width), dtype=torch.long, device=device)
        for row, e in enumerate(embedded):
            batch[row, : e.shape[0]] = e
            mask[row, : e.shape[0]] = 1
        out = self.model.get_encoder()(inputs_embeds=batch, attention_mask=mask).last_hidden_state
        return [out[row, : e.shape[0]] for row, e in enumerate(embedded)]

    @torch.inference_mode()
    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """One decoder token per sequence; next-token logits [n, vocab]."""
        unknown = [s for s in seq_ids if s not in self._slot_of]
        if unknown:
            raise ValueError(f"decode of sequences that are not running: {unknown}")
        slots = [self._slot_of[s] for s in seq_ids]
        if any(self._output_len[s] >= self.max_tokens for s in slots):
            raise ValueError(f"a sequence would exceed max_sequence_tokens ({self.max_tokens})")
        return self._step(slots, list(token_ids))

    def _step(
        self, slots: list[int], tokens: list[int], embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        device = self.device_obj
        positions = [self._output_len[s] for s in slots]
        slot_t = torch.tensor(slots, device=device)
        pos_t = torch.tensor(positions, device=device)
        self_len = max(positions) + 1
        lengths = [self._input_len[s] for s in slots]
        input_len = torch.tensor(lengths, device=device)
        cross_len = max(lengths)
        low = torch.finfo(self.dtype).min
        self_mask = torch.where(
            torch.arange(self_len, device=device)[None] > pos_t[:, None], low, 0.0
        ).to(self.dtype)[:, None]
        cross_mask = torch.where(
            torch.arange(cross_len, device=device)[None] >= input_len[:, None], low, 0.0
        ).to(self.dtype)[:, None]
        attend = Attend(
            self.self_keys, self.self_values, self.cross_keys, self.cross_values,
            slot_t, pos_t, self_len, cross_len, self_mask, cross_mask,
        )  # fmt: skip
        logits = self.decoder.step(torch.tensor(tokens, device=device), pos_t, attend, embeds)
        for slot in slots:
            self._output_len[slot] += 1
        return logits

    def release(self, seq_id: int) -> None:
        slot = self._slot_of.pop(seq_id, None)
        if slot is None:
            return
        self._output_len[slot] = 0
        self._input_len[slot] = 0
        self._free.append(slot)
        self._free.sort()

    # --- warmup ------------------------------------------------------------------------------

    def warmup_plan(self, max_batch_size: int, max_input_tokens: int) -> list[Shape]:
        """The longest input alone, then a decode of the whole batch."""
        rows = max(1, min(max_batch_size, self._capacity.max_sequences))
        return [
            Shape("prefill", 1, max(1, min(max_input_tokens, self.max_tokens))),
            Shape("decode", rows, 1),
        ]

    def warmup(
        self,
        max_batch_size: int,
        max_input_tokens: int,
        on_shape: Callable[[ShapeTiming], None] | None = None,
    ) -> list[ShapeTiming]:
        timings = []
        base = 1 << 30  # seq_ids no request uses
        for shape in self.warmup_plan(max_batch_size, max_input_tokens):
            start = time.perf_counter()
            if shape.phase == "prefill":
                item = PrefillItem(base, (self.start_token,) * shape.length)
                self.prefill([item])
                self.release(base)
            else:
                items = [PrefillItem(base + i, (self.start_token,)) for i in range(shape.rows)]
                self.prefill(items)
                self.decode([i.seq_id for i in items], [self.start_token] * shape.rows)
                for item in items:
                    self.release(item.seq_id)
            timing = ShapeTiming(shape, time.perf_counter() - start, 0)
            timings.append(timing)
            if on_shape is not None:
                on_shape(timing)
        return timings


def _rows(embeds: torch.Tensor | None) -> int:
    return 0 if embeds is None else int(embeds.shape[0])


__all__ = ["SUPPORTED", "Seq2SeqBackend", "decoder_for"]
