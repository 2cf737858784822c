"""The process that builds a store's packages (paged/packages.py): `python -m
tgis.backends.paged.build MODEL_DIR --store DIR ...` loads the model as the server did and
compiles every decode graph into the store; a failure is kept there (`PackageStore.fail`), so
that later starts decode eagerly at once."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from tgis.backends.paged.packages import PARENT_VARIABLE, PackageStore
from tgis.config import default_env

logger = logging.getLogger(__name__)


def end_with_parent() -> None:
    """SIGTERM this process when the server that started it ends, however it ends (Linux),
    so that no build outlives it; a server already gone ends it now."""
    parent = default_env().get(PARENT_VARIABLE)
    if parent is None or sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):
        sys.exit(143)


def main(argv: Sequence[str] | None = None) -> int:
    """The build process: load the model as the server does and compile every graph into the
    store (exit 0 when all are there; a failure is kept in the store, `PackageStore.fail`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].strip())
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--max-sequence-tokens", type=int, required=True)
    parser.add_argument("--dtype")
    parser.add_argument("--quantize")
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--kv-cache-dtype")
    parser.add_argument("--no-autotune", action="store_true")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    store = PackageStore(args.store)
    # Stopped by the server: unwind, so that no partial package is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    end_with_parent()
    try:
        return _build(args, store)
    except Exception as exc:  # kept: later starts serve eagerly without trying again
        logger.exception("building the compiled decode failed")
        store.fail(f"{type(exc).__name__}: {exc}")
        return 1


def _build(args: argparse.Namespace, store: PackageStore) -> int:
    """`main`'s build: every graph of GRAPHS into `store`."""
    import torch

    from tgis.backends.common.quant import Quantization
    from tgis.backends.paged.backend import PagedTorchBackend
    from tgis.backends.paged.compile import GRAPHS

    if args.threads:
        torch.set_num_threads(args.threads)
    quantization = Quantization(args.quantize, args.group_size) if args.quantize else None
    backend = PagedTorchBackend.load(
        args.model_dir,
        "cpu",
        args.dtype,
        max_sequences=max(GRAPHS),
        max_sequence_tokens=args.max_sequence_tokens,
        max_prefill_tokens=args.block_size,
        # A pool that holds one sequence (the compiling steps use a scratch pool of their own).
        kv_tokens=args.block_size * max(8, -(-args.max_sequence_tokens // args.block_size)),
        block_size=args.block_size,
        compile=True,
        packages=store,
        autotune=not args.no_autotune,
        quantization=quantization,
        # The pool's dtype as torch names it (float8_e4m3fn, ...).
        kv_cache_dtype=getattr(torch, args.kv_cache_dtype) if args.kv_cache_dtype else None,
    )
    assert backend.compiled is not None
    for graph in GRAPHS:
        backend.compiled.build(graph)
    return 0 if all(store.has(graph) for graph in GRAPHS) else 1


if __name__ == "__main__":
    sys.exit(main())
