"""The generic forward path: any causal LM's own `forward`, over the slot cache.

Works for every architecture whose attention layers go through `Cache.update` with states
shaped [batch, heads, tokens, head_dim] (llama, mistral, qwen2, gpt2, gpt_neox, bloom, falcon,
...). Each call passes an explicit 2D attention mask (1 = a real token of that row), explicit
position ids and cache_position, so HF builds the right causal + padding mask itself, and
alibi models (bloom, falcon with alibi) derive their per-row positions from the same mask.

Prompt rows are right-padded: a row's real tokens start at cache position 0, which is what the
slot cache and the decode masks assume.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from tgis.backends.common.kv import KVShape, sliding_windows
from tgis.backends.common.masks import place_embeds
from tgis.backends.fallback.forward import DecodeBatch, PrefillSegment, group_by_start
from tgis.backends.fallback.hf_cache import SlotCache
from tgis.backends.fallback.slot_cache import KVStep, SlotKVCache
from tgis.errors import ConfigError


@torch.inference_mode()
def probe_kv_shape(model: PreTrainedModel) -> KVShape:
    """Run two tokens through `model` with a DynamicCache and read the cached shapes.

    Asking the model instead of its config covers multi-query (falcon), fused-head (bloom)
    and any other layout transformers itself produces.
    """
    device = next(model.parameters()).device
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    out = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    cache = out.past_key_values
    layers = [(layer.keys, layer.values) for layer in getattr(cache, "layers", [])]
    if not layers or any(
        k is None or k.ndim != 4 or k.shape[0] != 1 or k.shape[2] != 2 for k, _ in layers
    ):
        raise ValueError(
            f"{type(model).__name__} does not cache keys as [batch, heads, tokens, head_dim]"
        )
    shapes = {(k.shape[1], k.shape[3], v.shape[1], v.shape[3]) for k, v in layers}
    if len(shapes) != 1:
        raise ValueError(f"{type(model).__name__} has layers of different KV shapes: {shapes}")
    heads, head_dim, v_heads, v_dim = shapes.pop()
    if v_heads != heads:
        raise ValueError(f"{type(model).__name__} caches {heads} key but {v_heads} value heads")
    return KVShape(len(layers), heads, head_dim, v_dim)


def pad_groups(lengths: Sequence[int], slack: float) -> list[list[int]]:
    """Indices of `lengths` in batches whose right-padding wastes at most `slack` of the real
    tokens (padded tokens cost as much as real ones on CPU: 8 prompts of 26..243 tokens run
    1.6x slower padded together than one by one). Longest first, so each batch's width is its
    first member's length."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for index in order:
        if groups:
            group = groups[-1]
            width, real = lengths[group[0]], sum(lengths[i] for i in group) + lengths[index]
            if width * (len(group) + 1) <= (1 + slack) * real:
                group.append(index)
                continue
        groups.append([index])
    return groups


class HFForward:
    """The model's own forward with a `SlotCache`; see the module docstring."""

    name = "hf"

    def __init__(self, model: PreTrainedModel, cache: SlotKVCache, pad_slack: float = 0.25) -> None:
        windows = [w for w in sliding_windows(model) if w is not None]
        if windows and min(windows) < cache.max_tokens:
            # HF's sliding-window mask is built from one cache_position shared by all rows,
            # which is only right for rows of equal length: refuse rather than attend wrongly.
            raise ConfigError(
                f"{type(model).__name__} uses a sliding window of {min(windows)} tokens, shorter "
                f"than max_sequence_tokens={cache.max_tokens}, which the generic forward path "
                "cannot mask per row",
                f"lower --max-total-tokens to {min(windows)} or less",
            )
        self.model = model
        self.cache = cache
        self.slot_cache = SlotCache(cache)
        self.device = cache.device
        self.pad_slack = pad_slack
        # Only pass what the forward declares: alibi models (bloom) take positions from the
        # attention mask and warn on position_ids; a model without cache_position derives
        # the same range from get_seq_length().
        params = inspect.signature(model.forward).parameters
        self._optional = {name for name in ("position_ids", "cache_position") if name in params}
        # Which hidden rows the lm_head should see: (batch_idx, seq_idx) or None for all.
        self._select: tuple[torch.Tensor, torch.Tensor] | None = None
        self._selected = False
        head = model.get_output_embeddings()
        if isinstance(head, nn.Module):
            # The hook holds this object weakly and goes away with it, so backends built and
            # dropped over one model (tests, reloads) leave no live hooks behind.
            this = weakref.ref(self)

            def gather(module: nn.Module, args: tuple) -> tuple | None:
                forward = this()
                return None if forward is None else forward._gather_rows(args)

            weakref.finalize(self, head.register_forward_pre_hook(gather).remove)

    def _gather_rows(self, args: tuple) -> tuple | None:
        """Before the lm_head: keep only the hidden states whose logits are wanted, so a long
        prompt never materialises [batch, tokens, vocab] logits."""
        if self._select is None or not args:
            return None
        hidden = args[0]  # [batch, tokens, hidden]
        self._selected = True
        return (hidden[self._select].unsqueeze(0), *args[1:])  # [1, rows, hidden]

    def _run(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        step: KVStep,
        select: tuple[torch.Tensor, torch.Tensor] | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One model call; returns float32 logits [rows, vocab] (selected rows, or all rows
        when select is None and input_ids has one column). `inputs_embeds` [batch, width,
        hidden] replaces the ids' embeddings (prompt prefixes)."""
        self.slot_cache.step = step
        self._select, self._selected = select, False
        optional = {
            "position_ids": position_ids,
            "cache_position": torch.arange(step.past_len, step.kv_len, device=self.device),
        }
        try:
            tokens = (
                {"input_ids": input_ids}
                if inputs_embeds is None
                else {"inputs_embeds": inputs_embeds}
            )
            out = self.model(
                **tokens,
                attention_mask=attention_mask,
                past_key_values=self.slot_cache,
                use_cache=True,
                **{k: v for k, v in optional.items() if k in self._optional},
            )
        finally:
            self.slot_cache.step = None
            self._select = None
        logits = out.logits
        if select is None:
            return logits[:, -1].float()
        if self._selected:
            return logits[0].float()
        return logits[select].float()  # the model bypassed its lm_head module

    def prefill(self, segments: Sequence[PrefillSegment]) -> list[torch.Tensor]:
        """Run the segments, write their K/V, return per segment float32 logits
        [len(input_ids), vocab] if `all_logits` else [1, vocab]."""
        results: list[torch.Tensor | None] = [None] * len(segments)
        for start, indices in group_by_start(segments).items():
            lengths = [len(segments[i].input_ids) for i in indices]
            for group in pad_groups(lengths, self.pad_slack):
                batch = [indices[i] for i in group]
                group = [segments[i] for i in batch]
                for i, logits in zip(batch, self._prefill_padded(start, group), strict=True):
                    results[i] = logits
        return [r for r in results if r is not None]

    def _prefill_padded(self, start: int, group: list[PrefillSegment]) -> list[torch.Tensor]:
        """Segments that all start at `start`, right-padded to the longest into one batch."""
        lengths = [len(s.input_ids) for s in group]
        width = max(lengths)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        rows: list[int] = []
        cols: list[int] = []
        for row, segment in enumerate(group):
            ids[row, : len(segment.input_ids)] = torch.tensor(segment.input_ids)
            keep = range(len(segment.input_ids)) if segment.all_logits else [lengths[row] - 1]
            rows.extend([row] * len(keep))
            cols.extend(keep)
        kv_len = start + width
        # [batch, kv_len]: 1 on the row's real tokens (cached ones and this segment's).
        real = torch.tensor([start + n for n in lengths])[:, None]
        mask = (torch.arange(kv_len)[None, :] < real).long()
        positions = torch.arange(start, kv_len).expand(len(group), width)
        slots = [s.slot for s in group]
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        step = KVStep(
            batch=len(group),
            query_len=width,
            kv_len=kv_len,
            slot_start=slots[0],
            slots=None if contiguous else torch.tensor(slots, device=self.device),
            start=start,
        )
        select = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
        embeds = None
        if any(s.embeds is not None for s in group):
            # Prompt-prefix rows: the model takes embeddings for the whole batch instead.
            embedding = self.model.get_input_embeddings()
            packed = embedding(ids.to(self.device)).reshape(len(group) * width, -1)
            overrides = [(row * width, s.embeds) for row, s in enumerate(group)]
            embeds = place_embeds(packed, overrides).reshape(len(group), width, -1)
        logits = self._run(
            ids.to(self.device),
            mask.to(self.device),
            positions.to(self.device),
            step,
            select,
            embeds,
        )
        counts = [lengths[i] if s.all_logits else 1 for i, s in enumerate(group)]
        return list(logits.split(counts))

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """Append one token per row, return float32 logits [n, vocab]."""
        positions = batch.positions
        # [n, kv_len]: row i sees positions 0..positions[i] (its past and the new token).
        keys = torch.arange(batch.kv_len, device=self.device)
        mask = (keys[None, :] <= positions[:, None]).long()
        return self._run(batch.input_ids[:, None], mask, positions[:, None], batch.step(), None)
