"""The paged backend's plain-torch attention under each of SDPA's kernels: a bfloat16 batch's
greedy tokens equal each request's alone. A mask a kernel misreads, a slot read before it was
written, or a row that sees another row's keys all move a row's logits far past the rounding
that bfloat16 allows between a batch and a request alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.backends.conftest import PROMPTS
from tests.factories import tiny_model
from tgis.backends.paged import attention as paged_attention_module
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine.backend import PackedItem

# Prompts of 7, 2, 13 and 40 tokens: the last spans three blocks of 16.
CASES = (*PROMPTS, tuple(range(10, 50)))
STEPS = 8
BLOCK = 16
# bfloat16 rounds a batch's GEMMs otherwise than one row's: logits part by about this much.
TOLERANCE = 0.05


def sdpa_backend(device: str, monkeypatch: pytest.MonkeyPatch) -> PagedTorchBackend:
    """A tiny bfloat16 Llama (head_dim 64, grouped KV heads) on `device` whose attention goes
    through SDPA: flash attention over pages turned off, and so CUDA graphs."""
    monkeypatch.setattr(paged_attention_module, "varlen_parameters", lambda: frozenset())
    model = tiny_model(
        "llama", seed=3, vocab_size=256, hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2,
    ).to(device, torch.bfloat16)  # fmt: skip
    backend = PagedTorchBackend(
        model, max_sequences=8, max_sequence_tokens=128, max_prefill_tokens=256,
        kv_tokens=64 * BLOCK, block_size=BLOCK, cuda_graphs=False, attention_backend="torch",
    )  # fmt: skip
    assert not backend.path.pool.flash
    return backend


def decode(
    backend: PagedTorchBackend,
    prompts: Sequence[Sequence[int]],
    first_block: int,
    feed: Sequence[Sequence[int]] | None = None,
) -> list[list[torch.Tensor]]:
    """The logits of each prompt, all in one batch: its prefill's last row, then one per
    decode step, each step fed `feed[i][k]` (None: the row's own greedy token). Each prompt
    has its own blocks, from `first_block` on."""
    per = -(-(max(len(p) for p in prompts) + STEPS + 1) // BLOCK)
    tables = [tuple(range(first_block + i * per, first_block + (i + 1) * per)) for i in range(len(prompts))]  # fmt: skip
    out = backend.forward([PackedItem(i, tuple(p), 0, tables[i]) for i, p in enumerate(prompts)])
    rows = [[row] for row in out.last.float().cpu()]
    for step in range(STEPS):
        tokens = [feed[i][step] if feed else int(r[-1].argmax()) for i, r in enumerate(rows)]
        out = backend.forward(
            [PackedItem(i, (tokens[i],), len(p) + step, tables[i]) for i, p in enumerate(prompts)]
        )
        for i, row in enumerate(out.last.float().cpu()):
            rows[i].append(row)
    return rows


def counting(calls: list[int]) -> Callable[..., torch.Tensor]:
    sdpa = F.scaled_dot_product_attention

    def count(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return sdpa(*args, **kwargs)

    return count


def check_batched_equals_alone(
    device: str, kernel: SDPBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each case greedily alone, then all in one batch fed the tokens they chose alone: every
    row's logits within TOLERANCE of its own alone, and the same token chosen wherever the
    alone run's best two logits are further apart than the logits may move (a near tie may
    go either way in bfloat16)."""
    backend = sdpa_backend(device, monkeypatch)
    calls: list[int] = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting(calls))
    try:
        with sdpa_kernel([kernel]):
            alone = [decode(backend, [case], first_block=0)[0] for case in CASES]
            chosen = [[int(row.argmax()) for row in rows] for rows in alone]
            batched = decode(backend, CASES, first_block=16, feed=chosen)
    except RuntimeError as exc:
        if "No available kernel" not in str(exc):
            raise
        pytest.skip(f"{kernel.name} runs none of the paged path's attention calls: {exc}")
    assert calls, "no attention went through SDPA"
    compared = 0
    for case, want, got in zip(CASES, alone, batched, strict=True):
        for step, (a, b) in enumerate(zip(want, got, strict=True)):
            where = f"{kernel.name}, prompt of {len(case)} tokens, step {step}"
            gap = float((b - a).abs().max())
            assert gap <= TOLERANCE, f"{where}: the logits part by {gap:.3f}"
            best, second = a.topk(2).values.tolist()
            if best - second > 2 * TOLERANCE:
                assert int(b.argmax()) == int(a.argmax()), where
                compared += 1
    assert compared > len(CASES) * STEPS // 2  # not all near ties


@pytest.mark.parametrize("kernel", [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], ids=str)
def test_batched_bf16_greedy_equals_alone_under_each_sdpa_kernel_on_cpu(
    kernel: SDPBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_batched_equals_alone("cpu", kernel, monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "kernel",
    [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ],
    ids=str,
)
def test_batched_bf16_greedy_equals_alone_under_each_sdpa_kernel_on_cuda(
    kernel: SDPBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_batched_equals_alone("cuda", kernel, monkeypatch)
