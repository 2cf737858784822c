"""The paged and the slot engine in process (no HTTP) on the same model and load.

Each engine serves (with `tgis serve`'s scheduler settings: TGI's waiting_served_ratio and
max_waiting_tokens for the slot engine, the same prefill budget for both) `--requests` requests of `--prompt-tokens` random token ids and
`--new-tokens` greedy tokens (EOS ignored), `--streams` at a time, one engine after the other;
prints tokens/s, steps and the time spent in the backend's forwards.

    python scripts/compare_engines.py --model-dir /tmp/tgis-bench/smollm2-135m-random --streams 32
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import time
from pathlib import Path

import torch


class StepTotals:
    """EngineObserver that sums the steps' counts and times."""

    def __init__(self) -> None:
        self.steps, self.tokens, self.forward, self.duration = 0, 0, 0.0, 0.0

    def on_step(
        self, method: str, batch: int, tokens: int, duration: float, forward: float
    ) -> None:
        self.steps += 1
        self.tokens += tokens
        self.forward += forward
        self.duration += duration

    def on_step_failure(self, method: str, reason: str) -> None:
        raise RuntimeError(f"a {method} step failed: {reason}")

    def on_concatenation(self) -> None:
        pass

    def on_batch_state(self, *_: int) -> None:
        pass

    def on_kv_state(self, *_: int) -> None:
        pass


def run(
    engine_kind: str, model: torch.nn.Module, tokenizer: object, args: argparse.Namespace
) -> str:
    from tgis.backends.fallback.backend import TorchDynamicBackend
    from tgis.backends.paged.backend import PagedTorchBackend
    from tgis.engine.engine import Engine
    from tgis.engine.scheduler import SchedulerLimits
    from tgis.engine.types import GenerationRequest
    from tgis.params import GenerateParameters

    total = args.prompt_tokens + args.new_tokens + 1
    common = {"max_sequences": args.streams, "max_sequence_tokens": total}
    if engine_kind == "paged":
        backend = PagedTorchBackend(
            copy.deepcopy(model),
            max_prefill_tokens=args.prefill_tokens,
            kv_tokens=args.streams * total,
            **common,
        )
    else:
        backend = TorchDynamicBackend(
            copy.deepcopy(model), kv_tokens=args.streams * total, **common
        )
    cap = backend.capacity
    limits = SchedulerLimits(
        max_batch_prefill_tokens=args.prefill_tokens,
        max_batch_total_tokens=cap.kv_tokens,
        max_sequences=args.streams,
        prefill_step_tokens=cap.prefill_step_tokens,
    )
    totals = StepTotals()
    eos = [tokenizer.eos_token_id]  # type: ignore[attr-defined]
    engine = Engine(backend, tokenizer, limits, 4 * args.streams, eos, totals, prefix_caching=True)
    rng = random.Random(args.seed)
    params = GenerateParameters(max_new_tokens=args.new_tokens, ignore_eos=True)
    queue = [
        GenerationRequest(
            f"r{i}", tuple(rng.randrange(10, 1000) for _ in range(args.prompt_tokens)), params
        )
        for i in range(args.requests)
    ]

    async def load() -> int:
        count = 0

        async def user() -> None:
            nonlocal count
            while queue:
                async for _ in engine.generate(queue.pop()):
                    count += 1

        await asyncio.gather(*(user() for _ in range(args.streams)))
        return count

    engine.start()
    try:
        start = time.perf_counter()
        tokens = asyncio.run(load())
        wall = time.perf_counter() - start
    finally:
        engine.stop()
    return (
        f"{engine_kind:<6} {tokens / wall:8.1f} tok/s  {wall:6.1f} s  {totals.steps:5d} steps  "
        f"forward {totals.forward:6.1f} s  step tokens {totals.tokens}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=110)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=4096,
        help="--max-batch-prefill-tokens of both (the cpu backends cap a step at 512 anyway)",
    )
    parser.add_argument("--engines", default="paged,slot")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tgis.backends.common.device import cpu_threads

    torch.set_num_threads(cpu_threads())
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    for kind in args.engines.split(","):
        print(run(kind.strip(), model, tokenizer, args), flush=True)


if __name__ == "__main__":
    main()
