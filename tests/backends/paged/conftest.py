"""What every paged-engine test runs under: KV pools filled with NaN where nothing was written
(a slot that should never be read cannot hide behind a zero), and attention masks that are
boolean or in the query's dtype (a float mask of another dtype is misread by some of SDPA's
CUDA backends)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tgis.backends.paged.forward import KVPool

_ALLOCATE = KVPool.allocate.__func__  # type: ignore[attr-defined]
_SDPA = F.scaled_dot_product_attention


def nan_allocate(cls: type[KVPool], *args: Any, **kwargs: Any) -> KVPool:
    """`KVPool.allocate`, every slot NaN until a step writes it."""
    pool = _ALLOCATE(cls, *args, **kwargs)
    for tensor in (*pool.keys, *pool.values):
        tensor.fill_(float("nan"))
    return pool


def strict_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """SDPA that refuses a mask neither boolean nor in the query's dtype."""
    mask = kwargs.get("attn_mask", args[0] if args else None)
    if mask is not None and mask.dtype not in (torch.bool, query.dtype):
        raise AssertionError(
            f"an attention mask in {mask.dtype} for queries in {query.dtype}: masks are "
            "boolean or in the query's dtype"
        )
    return _SDPA(query, key, value, *args, **kwargs)


@pytest.fixture(autouse=True)
def nan_pools_and_strict_masks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(KVPool, "allocate", classmethod(nan_allocate))
    monkeypatch.setattr(F, "scaled_dot_product_attention", strict_sdpa)
    yield
