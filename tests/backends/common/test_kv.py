"""tgis.backends.common.kv: `--kv-cache-dtype`'s names map to torch's float8 dtypes, and a
float8 cache stores each value rounded to the format, saturating at its largest finite value
where a plain cast would give infinity (e5m2) or rely on the cast's own clamping (e4m3fn)."""

from __future__ import annotations

import pytest
import torch

from tgis.backends.common.kv import FLOAT8_KV, kv_bytes_per_token, kv_dtype, to_cache
from tgis.config.types import KV_CACHE_DTYPES


def test_every_float8_name_has_a_dtype() -> None:
    assert kv_dtype(None) is None
    assert sorted(FLOAT8_KV) == sorted(n for n in KV_CACHE_DTYPES if n != "auto")
    assert kv_dtype("fp8_e4m3fn") is torch.float8_e4m3fn
    assert kv_bytes_per_token(2, 4, 8, torch.float8_e5m2) * 4 == kv_bytes_per_token(
        2, 4, 8, torch.float32
    )


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_a_float8_cache_rounds_and_saturates(dtype: torch.dtype) -> None:
    limit = torch.finfo(dtype).max
    values = torch.tensor([0.0, 0.3, -2.7, 1e3, -1e6, 1e9])
    stored = to_cache(values, dtype)
    assert stored.dtype == dtype
    widened = stored.float()
    assert torch.isfinite(widened).all()
    assert widened[4:].tolist() == [-limit, limit]
    # In range (1e3 is beyond e4m3fn's 448), the nearest representable value: within half a
    # step of 2**-mantissa.
    mantissa = 3 if dtype == torch.float8_e4m3fn else 2
    expected = values[:4].clamp(-limit, limit)
    assert ((widened[:4] - expected).abs() <= expected.abs() * 2.0 ** -(mantissa + 1)).all()
    assert torch.equal(to_cache(values, torch.bfloat16), values.to(torch.bfloat16))
