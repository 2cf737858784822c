"""Decode ms/step of the cpu / cuda engines' forwards vs HF's own `model(...)`.

Builds a random Llama with SmolLM2-135M's shape (vocab 49152, hidden 576, 30 layers, 9 heads,
3 KV heads, intermediate 1536, tied embeddings), prefills `batch` prompts of `--context`
tokens for each contender, then runs `--steps` decode steps of every contender in turn (one
step each, round robin, so a burst of load from another process hits them all alike) and
prints the median ms per step:

- hf-dynamic: `model(input_ids[b, 1], past_key_values=DynamicCache)`, the bare HF forward
  over equal-length rows without padding (HF's best case; no sampling, no generate());
- paged: `PagedTorchBackend.forward` of one decode token per row, equal-length rows;
- paged-ragged: the same with prompt lengths spread over context/2..context;
- fallback: `TorchDynamicBackend.decode`, transformers' forward over the slot cache (with
  --fallback).

    .venv/bin/python scripts/measure_decode.py --batches 1 16 32 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tgis.backends.fallback.backend import TorchDynamicBackend
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine.backend import PackedItem, PrefillItem

Step = Callable[[], object]


def smollm2_shaped(dtype: torch.dtype) -> LlamaForCausalLM:
    from bench_serve import SMOLLM2_135M  # the shape make bench serves (scripts/ is on sys.path)

    config = LlamaConfig(**{**SMOLLM2_135M, "max_position_embeddings": 8192}, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


@torch.inference_mode()
def hf_dynamic(model: LlamaForCausalLM, batch: int, context: int) -> Step:
    """Prefill `batch` rows into a DynamicCache; return one bare decode step of HF's model."""
    ids = torch.randint(4, model.config.vocab_size, (batch, context))
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    token = torch.randint(4, model.config.vocab_size, (batch, 1))

    @torch.inference_mode()
    def step() -> object:
        return model(input_ids=token, past_key_values=cache, use_cache=True)

    return step


def paged_decode(backend: PagedTorchBackend, lengths: list[int]) -> Step:
    """Prefill prompts of `lengths` into `backend`'s pool, each in blocks of its own; return
    one decode step of all of them (each step writes the same next position again)."""
    gen = torch.Generator().manual_seed(len(lengths))
    block = backend.capacity.block_size or 1
    per_row = -(-(max(lengths) + 1) // block)
    tables = [tuple(range(i * per_row, (i + 1) * per_row)) for i in range(len(lengths))]
    for seq_id, n in enumerate(lengths):  # one by one: bounded prefill memory
        prompt = tuple(torch.randint(4, backend.vocab_size, (n,), generator=gen).tolist())
        backend.forward([PackedItem(seq_id, prompt, 0, tables[seq_id])])
    items = [PackedItem(i, (5,), n, tables[i]) for i, n in enumerate(lengths)]
    return lambda: backend.forward(items)


def fallback_decode(backend: TorchDynamicBackend, lengths: list[int]) -> Step:
    """Prefill prompts of `lengths` into `backend`; return one decode step of all of them."""
    gen = torch.Generator().manual_seed(len(lengths))
    ids = list(range(len(lengths)))
    for seq_id, n in zip(ids, lengths, strict=True):  # one by one: bounded prefill memory
        prompt = tuple(torch.randint(4, backend.vocab_size, (n,), generator=gen).tolist())
        backend.prefill([PrefillItem(seq_id, prompt)])
    return lambda: backend.decode(ids, [5] * len(ids))


def interleaved_ms(steps: list[Step], count: int, warmup: int = 2) -> list[float]:
    """Median ms of each step function, run round robin `count` times after `warmup`."""
    times: list[list[float]] = [[] for _ in steps]
    for index in range(warmup + count):
        for step, seen in zip(steps, times, strict=True):
            start = time.perf_counter()
            step()
            if index >= warmup:
                seen.append(time.perf_counter() - start)
    return [statistics.median(seen) * 1e3 for seen in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--fallback", action="store_true", help="also time the fallback engine's forward"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = smollm2_shaped(getattr(torch, args.dtype))
    max_batch = max(args.batches)
    total = args.context + args.steps + 4
    limits = {"max_sequences": max_batch, "max_sequence_tokens": total}
    limits["kv_tokens"] = max_batch * total

    def paged() -> PagedTorchBackend:
        pool = {**limits, "kv_tokens": max_batch * (total + 16)}  # whole blocks per row
        return PagedTorchBackend(model, max_prefill_tokens=args.context, block_size=16, **pool)

    # Each backend has its own pool; the paged ones share (re-fused) weights with `model`.
    fallback = TorchDynamicBackend(model, **limits) if args.fallback else None
    even_backend, ragged_backend = paged(), paged()
    print(
        f"threads={torch.get_num_threads()} dtype={args.dtype} context={args.context} "
        f"steps={args.steps} (median ms per decode step)"
    )
    columns = ["hf-dynamic", "paged", "paged-ragged"] + (["fallback"] if fallback else [])
    print(f"{'batch':>5} " + " ".join(f"{c:>13}" for c in columns) + f" {'speedup':>8}")
    for batch in args.batches:
        even = [args.context] * batch
        ragged = [args.context - (args.context // 2) * i // max(1, batch - 1) for i in range(batch)]
        steps = [
            hf_dynamic(model, batch, args.context),
            paged_decode(even_backend, even),
            paged_decode(ragged_backend, ragged),
        ]
        if fallback is not None:
            steps.append(fallback_decode(fallback, even))
        row = interleaved_ms(steps, args.steps)
        for seq_id in range(batch if fallback is not None else 0):
            fallback.release(seq_id)  # type: ignore[union-attr]
        cells = " ".join(f"{v:13.1f}" for v in row)
        print(f"{batch:>5} {cells} {row[0] / row[1]:7.1f}x", flush=True)


if __name__ == "__main__":
    main()
