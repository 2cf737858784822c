"""tgis.config.dtypes: the one table of dtype names."""

from __future__ import annotations

import pytest

from tgis.config.dtypes import CAST_TO_DTYPE, DTYPES, cast_type, dtype_bytes, normalize_dtype
from tgis.errors import ConfigError


@pytest.mark.parametrize(
    ("raw", "name"),
    [("fp16", "float16"), ("HALF", "float16"), ("bf16", "bfloat16"), ("float", "float32")],
)
def test_aliases_normalize(raw: str, name: str) -> None:
    assert normalize_dtype(raw) == name


def test_unknown_dtype_names_the_source() -> None:
    with pytest.raises(ConfigError) as info:
        normalize_dtype("int4", "DTYPE=")
    assert (
        str(info.value)
        == "DTYPE= 'int4' is not a supported dtype (use one of float32, float16, bfloat16)"
    )
    assert normalize_dtype(None) is None


def test_neuron_cast_names_round_trip() -> None:
    assert {cast_type(CAST_TO_DTYPE[c]) for c in CAST_TO_DTYPE} == set(CAST_TO_DTYPE)
    assert cast_type("torch.bfloat16") == "bf16" and cast_type("fp32") == "fp32"
    assert cast_type("int8") == "int8" and cast_type(None) is None
    assert set(CAST_TO_DTYPE.values()) == set(DTYPES)


def test_element_sizes() -> None:
    assert [dtype_bytes(d) for d in DTYPES] == [4, 2, 2]
    assert dtype_bytes("torch.float32") == 4 and dtype_bytes("fp16") == 2
    assert dtype_bytes("mystery", default=1) == 1


def test_torch_names_match() -> None:
    torch = pytest.importorskip("torch")
    from tgis.backends.common.device import torch_dtype

    for name in DTYPES:
        assert torch_dtype(name) is getattr(torch, name)
        assert torch_dtype(name).itemsize == dtype_bytes(name)
    with pytest.raises(ValueError, match="'fp8' is not one of float32, float16, bfloat16"):
        torch_dtype("fp8")
