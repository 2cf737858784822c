"""Continuous-batching scenarios shared by the backend suites (cpu, static batch, XLA)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import torch

from tgis.engine.backend import Backend, PrefillItem


def random_prompts(
    count: int, seed: int, vocab: int, max_len: int = 20, max_new: int = 12
) -> tuple[list[tuple[int, ...]], list[int]]:
    """`count` prompts of 1..max_len tokens (ids >= 4, clear of special ids) and a token
    budget of 3..max_new per prompt, reproducible from `seed`."""
    rng = random.Random(seed)
    prompts = [
        tuple(rng.randrange(4, vocab) for _ in range(rng.randint(1, max_len))) for _ in range(count)
    ]
    return prompts, [rng.randint(3, max_new) for _ in range(count)]


def alone_run(
    backend: Backend, prompt: tuple[int, ...], new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits that chose them, for `prompt` alone in `backend`."""
    logits = [backend.prefill([PrefillItem(0, prompt)]).last[0]]
    tokens = [int(logits[0].argmax())]
    for _ in range(new_tokens - 1):
        logits.append(backend.decode([0], [tokens[-1]])[0])
        tokens.append(int(logits[-1].argmax()))
    backend.release(0)
    return tokens, logits


def staggered_greedy(
    backend: Backend,
    prompts: Sequence[tuple[int, ...]],
    budgets: Sequence[int],
    joins: Mapping[int, Sequence[int]],
    seed: int = 7,
    subsets: bool = True,
) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
    """Sequences join at the steps `joins` gives (step -> sequence indices), decode greedily in
    shuffled order (with `subsets`, every 4th step only every other one runs) and leave once
    they have their budget. Returns each sequence's tokens and logits."""
    rng = random.Random(seed)
    tokens: dict[int, list[int]] = {}
    logits: dict[int, list[torch.Tensor]] = {}
    released: set[int] = set()
    step = 0
    while step <= max(joins) or len(released) < len(tokens):
        for seq_id, seq in tokens.items():
            if len(seq) == budgets[seq_id] and seq_id not in released:
                backend.release(seq_id)
                released.add(seq_id)
        running = sorted(tokens.keys() - released)
        if subsets and step % 4 == 3 and len(running) > 2:
            running = running[1::2]
        rng.shuffle(running)
        if running:
            out = backend.decode(running, [tokens[s][-1] for s in running])
            for seq_id, row in zip(running, out, strict=True):
                logits[seq_id].append(row)
                tokens[seq_id].append(int(row.argmax()))
        new = list(joins.get(step, ()))
        if new:
            out = backend.prefill([PrefillItem(s, prompts[s]) for s in new])
            for seq_id, row in zip(new, out.last, strict=True):
                logits[seq_id], tokens[seq_id] = [row], [int(row.argmax())]
        step += 1
    return tokens, logits
