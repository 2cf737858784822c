"""tgis.backends.common.gemm: oneDNN-packed weights compute what F.linear does, and the probe
chooses them only where they are measured clearly faster."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tgis.backends.common import gemm

needs_packing = pytest.mark.skipif(
    not gemm.packing_available(), reason="this torch has no oneDNN packed linear"
)


@needs_packing
@pytest.mark.parametrize("rows", [0, 1, 16, 300])
def test_a_packed_weight_computes_what_f_linear_does(rows: int) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator)
    packed = gemm.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    # A row slice of a wider activation (not contiguous), with and without a bias.
    x = torch.randn(rows, 80, generator=generator)[:, 8:72]
    with torch.inference_mode():
        for b in (None, bias):
            torch.testing.assert_close(
                gemm.linear(x, packed, b), F.linear(x, weight, b), atol=1e-5, rtol=1e-5
            )
        batched = torch.randn(2, 5, 64, generator=generator)
        torch.testing.assert_close(
            gemm.linear(batched, packed), F.linear(batched, weight), atol=1e-5, rtol=1e-5
        )
    # A plain weight goes to F.linear itself.
    assert torch.equal(gemm.linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize(
    ("onednn_ms", "aten_ms", "packed"),
    [(2.0, 4.0, True), (3.5, 3.8, False), (4.0, 2.0, False)],
    ids=["twice-as-fast", "within-the-margin", "slower"],
)
def test_packing_is_chosen_only_where_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, onednn_ms: float, aten_ms: float, packed: bool
) -> None:
    timed: list[tuple[torch.dtype, int, int, bool]] = []

    def probe(dtype: torch.dtype, hidden: int, intermediate: int, packed: bool = False) -> float:
        timed.append((dtype, hidden, intermediate, packed))
        return (onednn_ms if packed else aten_ms) / 1000

    monkeypatch.setattr(gemm, "packing_available", lambda: True)
    monkeypatch.setattr(gemm, "decode_matmul_seconds", probe)
    chosen, why = gemm.choose_packing.__wrapped__(torch.float32, 2048, 8192)
    assert chosen == packed
    assert f"oneDNN packed {onednn_ms:.2f} ms, MKL {aten_ms:.2f} ms" in why
    assert sorted(timed) == [(torch.float32, 2048, 8192, False), (torch.float32, 2048, 8192, True)]
    # A tiny model is timed at the floor's shape, where the order of the kernels is measurable.
    timed.clear()
    gemm.choose_packing.__wrapped__(torch.float32, 64, 128)
    assert {t[1:3] for t in timed} == {gemm.PACKING_PROBE_FLOOR}


def test_packing_falls_back_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "packing_available", lambda: False)
    assert gemm.choose_packing.__wrapped__(torch.float32, 64, 128) == (
        False,
        "this torch has no oneDNN packed linear",
    )

    def unsupported(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("bf16 path needs the cpu support avx512bw\nmore")

    monkeypatch.setattr(gemm, "packing_available", lambda: True)
    monkeypatch.setattr(gemm, "pack", unsupported)
    chosen, why = gemm.choose_packing.__wrapped__(torch.bfloat16, 64, 128)
    assert not chosen
    assert (
        why == "oneDNN cannot pack bfloat16 weights here (bf16 path needs the cpu support avx512bw)"
    )


@needs_packing
def test_the_packing_probe_times_real_matmuls() -> None:
    assert 0 < gemm.decode_matmul_seconds(torch.float32, 64, 128, packed=True) < math.inf
