"""The paged-attention kernels on one device, in achieved bandwidth: `make gpu-check`'s kernels
stage (`python scripts/bench_kernels.py --out kernels.json`).

1. The device's copy bandwidth: a large device-to-device copy (bytes read plus written per
   second), the bar that decode attention, which reads every key and value once, can reach.
2. Decode attention, one query per sequence, at each batch and context (Llama-3.1-8B's
   attention by default: 32 query heads over 8 KV heads of 128 dims, bfloat16, pages of 256
   tokens scattered through the pool): tgis's Triton kernel, flash attention's `varlen_attn`
   over the same pages where this torch has it, and torch's SDPA over a dense copy of the
   same keys and values (no paging: the peer any torch has). Each reports milliseconds per
   call, the K/V bytes it read per second, and that as a share of the copy bandwidth.
3. A prompt's causal attention over its own keys (one sequence, --prefill tokens) by each
   kernel, in milliseconds and TFLOP/s.

Every kernel's result is checked against SDPA's first (`max_diff`); a kernel that cannot run
here is listed with the reason. On a CPU the Triton kernel runs only under Triton's
interpreter (TRITON_INTERPRET=1), which the tests use with a tiny --shape.

    python scripts/bench_kernels.py --out kernels.json [--batches 1,16,64] [--contexts 512,2048,8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    """One model's attention and the pool's pages."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 256
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class Plan:
    shape: Shape = field(default_factory=Shape)
    batches: tuple[int, ...] = (1, 16, 64)
    contexts: tuple[int, ...] = (512, 2048, 8192)
    prefill: int = 4096
    iters: int = 20
    copy_mib: int = 1024


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: Any, iters: int) -> float:
    """Seconds per call of `fn`, back to back after one unmeasured call."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def copy_bandwidth(device: Any, mib: int, iters: int) -> float:
    """Bytes per second a device-to-device copy of `mib` MiB reads and writes."""
    import torch

    source = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = timed(lambda: target.copy_(source), device, iters)
    return 2 * source.numel() / seconds


@dataclass
class Pages:
    """A batch of sequences' keys and values in scattered pages, and the same densely."""

    k_cache: Any
    v_cache: Any
    block_table: Any
    seqused_k: Any
    dense_k: Any  # [batch, kv_heads, context, head_dim]
    dense_v: Any


def make_pages(shape: Shape, batch: int, context: int, device: Any, seed: int = 0) -> Pages:
    import torch

    dtype = getattr(torch, shape.dtype)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = -(-context // shape.block_size)
    blocks = batch * per_seq
    page = (blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(page, generator=generator).to(device=device, dtype=dtype)
    v_cache = torch.randn(page, generator=generator).to(device=device, dtype=dtype)
    order = torch.randperm(blocks, generator=generator).to(device)
    table = order.view(batch, per_seq).int()

    def dense(cache: Any) -> Any:
        rows = cache[table.long()].reshape(batch, per_seq * shape.block_size, shape.kv_heads, -1)
        return rows[:, :context].transpose(1, 2).contiguous()

    used = torch.full((batch,), context, dtype=torch.int32, device=device)
    return Pages(k_cache, v_cache, table, used, dense(k_cache), dense(v_cache))


def kernels_here(device: Any, dtype: Any) -> dict[str, str | None]:
    """Each kernel, and why it cannot run here (None: it runs)."""
    from tgis.backends.paged.attention import attention_path, flash_paged_available
    from tgis.backends.paged.triton_attention import triton_available

    flash = flash_paged_available(device, dtype)
    return {
        "triton": triton_available(device),
        "flash": None
        if flash
        else attention_path(device, dtype).split("(flash attention ")[-1][:-1],
        "sdpa": None,
    }


def decode_calls(
    shape: Shape, pages: Pages, query: Any, context: int, available: dict[str, str | None]
) -> dict[str, Callable[[], Any]]:
    """Each runnable kernel's decode call over `pages` (one query row per sequence)."""
    import torch

    from tgis.backends.paged.attention import paged_attention
    from tgis.backends.paged.triton_attention import paged_attention_triton

    batch = query.shape[0]
    scale = shape.head_dim**-0.5
    cu_seq_q = torch.arange(batch + 1, dtype=torch.int32, device=query.device)
    step = (query, pages.k_cache, pages.v_cache, cu_seq_q, pages.seqused_k, pages.block_table)
    calls: dict[str, Callable[[], Any]] = {}
    if available["triton"] is None:
        calls["triton"] = lambda: paged_attention_triton(*step, scale, 1, max_k=context)
    if available["flash"] is None:
        calls["flash"] = lambda: paged_attention(*step, scale, 1, context)
    sdpa_q = query.unsqueeze(2)  # [batch, heads, 1, dim]

    def sdpa() -> Any:
        out = torch.nn.functional.scaled_dot_product_attention(
            sdpa_q, pages.dense_k, pages.dense_v, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)

    calls["sdpa"] = sdpa
    return calls


def prefill_calls(
    shape: Shape, pages: Pages, query: Any, available: dict[str, str | None]
) -> dict[str, Callable[[], Any]]:
    """Each runnable kernel's causal attention of one prompt over its own keys."""
    import torch

    from tgis.backends.paged.attention import paged_attention
    from tgis.backends.paged.triton_attention import paged_attention_triton

    tokens = query.shape[0]
    scale = shape.head_dim**-0.5
    cu_seq_q = torch.tensor([0, tokens], dtype=torch.int32, device=query.device)
    step = (query, pages.k_cache, pages.v_cache, cu_seq_q, pages.seqused_k, pages.block_table)
    calls: dict[str, Callable[[], Any]] = {}
    if available["triton"] is None:
        calls["triton"] = lambda: paged_attention_triton(*step, scale, tokens, max_k=tokens)
    if available["flash"] is None:
        calls["flash"] = lambda: paged_attention(*step, scale, tokens, tokens)
    sdpa_q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, dim]

    def sdpa() -> Any:
        out = torch.nn.functional.scaled_dot_product_attention(
            sdpa_q, pages.dense_k, pages.dense_v, scale=scale, is_causal=True, enable_gqa=True
        )
        return out[0].transpose(0, 1)

    calls["sdpa"] = sdpa
    return calls


def measure(
    calls: dict[str, Callable[[], Any]], device: Any, iters: int
) -> dict[str, tuple[float, float]]:
    """Each call's seconds and its largest difference from SDPA's result."""
    expected = calls["sdpa"]().float()
    results = {}
    for name, call in calls.items():
        diff = float((call().float() - expected).abs().max())
        results[name] = (timed(call, device, iters), diff)
    return results


def run(plan: Plan, device: Any) -> dict[str, Any]:
    """Every row of the plan on `device`: the copy bandwidth, decode and prefill rows."""
    import torch

    shape = plan.shape
    dtype = getattr(torch, shape.dtype)
    available = kernels_here(device, dtype)
    bandwidth = copy_bandwidth(device, plan.copy_mib, plan.iters)
    item = torch.finfo(dtype).bits // 8
    rows: list[dict[str, Any]] = []
    generator = torch.Generator(device="cpu").manual_seed(1)
    for batch in plan.batches:
        for context in plan.contexts:
            pages = make_pages(shape, batch, context, device)
            query = torch.randn(batch, shape.heads, shape.head_dim, generator=generator)
            query = query.to(device=device, dtype=dtype)
            kv_bytes = 2 * batch * context * shape.kv_heads * shape.head_dim * item
            for name, (seconds, diff) in measure(
                decode_calls(shape, pages, query, context, available), device, plan.iters
            ).items():
                rate = kv_bytes / seconds
                rows.append({
                    "kind": "decode", "batch": batch, "context": context, "kernel": name,
                    "ms": round(seconds * 1e3, 4), "gbps": round(rate / 1e9, 3),
                    "of_copy": round(rate / bandwidth, 3), "max_diff": diff,
                })  # fmt: skip
            del pages
    if plan.prefill:
        pages = make_pages(shape, 1, plan.prefill, device)
        query = torch.randn(plan.prefill, shape.heads, shape.head_dim, generator=generator)
        query = query.to(device=device, dtype=dtype)
        flops = 2 * shape.heads * shape.head_dim * plan.prefill * plan.prefill  # causal half
        for name, (seconds, diff) in measure(
            prefill_calls(shape, pages, query, available), device, max(1, plan.iters // 4)
        ).items():
            rows.append({
                "kind": "prefill", "batch": 1, "context": plan.prefill, "kernel": name,
                "ms": round(seconds * 1e3, 4), "tflops": round(flops / seconds / 1e12, 2),
                "max_diff": diff,
            })  # fmt: skip
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": asdict(shape),
        "copy_gbps": round(bandwidth / 1e9, 1),
        "unavailable": {name: why for name, why in available.items() if why is not None},
        "rows": rows,
    }


def table(data: dict[str, Any]) -> str:
    """The decode rows as a markdown table (GB/s and share of the copy bandwidth per kernel),
    and the prefill rows in a line."""
    kernels = sorted({r["kernel"] for r in data["rows"]}, key=["triton", "flash", "sdpa"].index)
    shape = data["shape"]
    head = (
        f"Decode attention on {data['device']} (torch {data['torch']}): {shape['heads']} query "
        f"heads over {shape['kv_heads']} KV heads of {shape['head_dim']} dims, "
        f"{shape['dtype']}, pages of {shape['block_size']} tokens; copy bandwidth "
        f"{data['copy_gbps']:,.0f} GB/s. Each cell: GB/s of keys and values read "
        "(share of the copy bandwidth), ms per call."
    )
    lines = [head, "", "| batch | context | " + " | ".join(kernels) + " |"]
    lines.append("|---:|---:|" + "---:|" * len(kernels))
    decode = [r for r in data["rows"] if r["kind"] == "decode"]
    for batch, context in dict.fromkeys((r["batch"], r["context"]) for r in decode):
        cells = []
        for kernel in kernels:
            row = next(
                (
                    r
                    for r in decode
                    if (r["batch"], r["context"], r["kernel"]) == (batch, context, kernel)
                ),
                None,
            )
            cells.append(
                "-" if row is None
                else f"{row['gbps']:,.0f} ({row['of_copy']:.0%}), {row['ms']:.3f} ms"
            )  # fmt: skip
        lines.append(f"| {batch} | {context:,} | " + " | ".join(cells) + " |")
    prefill = [r for r in data["rows"] if r["kind"] == "prefill"]
    if prefill:
        parts = [f"{r['kernel']} {r['ms']:.2f} ms ({r['tflops']:.0f} TFLOP/s)" for r in prefill]
        lines += [
            "",
            f"Causal prefill of {prefill[0]['context']:,} tokens: " + ", ".join(parts) + ".",
        ]
    if data["unavailable"]:
        why = "; ".join(f"{k}: {v}" for k, v in data["unavailable"].items())
        lines += ["", f"Not run: {why}."]
    return "\n".join(lines)


def verdict(
    data: dict[str, Any], batch: int = 64, context: int = 2048, share: float = 0.6
) -> str | None:
    """The target's line: decode attention at `batch` rows and `context` tokens reaching
    `share` of the copy bandwidth with the Triton kernel (None: that row was not run)."""
    row = next(
        (r for r in data["rows"]
         if (r["kind"], r["batch"], r["context"], r["kernel"]) == ("decode", batch, context, "triton")),
        None,
    )  # fmt: skip
    if row is None:
        return None
    met = "met" if row["of_copy"] >= share else "NOT met"
    return (
        f"Triton decode attention at batch {batch}, {context:,} context: {row['of_copy']:.0%} of "
        f"the copy bandwidth (target {share:.0%}): {met}"
    )


def numbers(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sys.exit(f"{text!r} is not a comma list of whole numbers, e.g. 1,16,64")
    if not values or min(values) < 1:
        sys.exit(f"{text!r} must list numbers >= 1")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the results' JSON file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=numbers, default=Plan.batches)
    parser.add_argument("--contexts", type=numbers, default=Plan.contexts)
    parser.add_argument("--prefill", type=int, default=Plan.prefill, help="0: no prefill row")
    parser.add_argument("--iters", type=int, default=Plan.iters)
    parser.add_argument("--copy-mib", type=int, default=Plan.copy_mib)
    parser.add_argument(
        "--shape", type=numbers, default=None,
        help="HEADS,KV_HEADS,HEAD_DIM,BLOCK_SIZE (default: Llama-3.1-8B's, pages of 256)",
    )  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(ROOT))
    args = parse_args(argv)
    shape = Shape(*(args.shape or ()), dtype=args.dtype) if args.shape else Shape(dtype=args.dtype)
    if args.shape and len(args.shape) != 4:
        sys.exit("--shape takes four numbers: HEADS,KV_HEADS,HEAD_DIM,BLOCK_SIZE")
    plan = Plan(shape, args.batches, args.contexts, args.prefill, args.iters, args.copy_mib)
    data = run(plan, torch.device(args.device))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2))
    print(table(data))
    line = verdict(data)
    if line:
        print(f"\n{line}")
    return data


if __name__ == "__main__":
    main()
