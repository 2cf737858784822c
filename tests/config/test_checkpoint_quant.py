"""What tgis reads of a pre-quantized checkpoint's quantization_config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tgis.config.checkpoint_quant import CheckpointQuant, declared_quantization
from tgis.errors import ConfigError


def of(declared: object) -> CheckpointQuant | None:
    return CheckpointQuant.of({"quantization_config": declared})


def test_each_format_is_read_into_its_scheme() -> None:
    assert CheckpointQuant.of({}) is None
    gptq = of({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True})
    assert gptq == CheckpointQuant("gptq", 4, 128, zero_offset=1, act_order=True)
    assert gptq.describe() == "gptq checkpoint, 4-bit weights in groups of 128, act-order"
    v2 = of({"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"})
    assert v2 == CheckpointQuant("gptq", 4, None, zero_offset=0)
    assert v2.describe() == "gptq checkpoint, 4-bit weights in groups as stored"
    # AutoAWQ's older names.
    assert of({"quant_method": "awq", "w_bit": 4, "q_group_size": 64}) == CheckpointQuant(
        "awq", 4, 64
    )
    fp8 = of({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert fp8 == CheckpointQuant("fp8", 8, block=(128, 128), float8=True)
    assert (
        fp8.describe() == "fp8 checkpoint, weight scales blocks of 128x128, activations per token"
    )
    w8a8 = of({
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
        }}},
    })  # fmt: skip
    assert w8a8 is not None and w8a8.float8 and w8a8.bits == 8
    w4a16 = of({
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
            "actorder": "group",
        }}},
    })  # fmt: skip
    assert w4a16 == CheckpointQuant("compressed-tensors", 4, 128, act_order=True)


@pytest.mark.parametrize(
    ("declared", "field"),
    [
        ("gptq", "quantization_config is not an object"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "quantization_config.group_size"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "compressed-tensors", "format": "int-quantized",
          "sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
        ({"quant_method": "hqq"}, "quant_method is 'hqq'"),
    ],
)  # fmt: skip
def test_what_cannot_be_read_is_refused_by_field(declared: object, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        of(declared)


def test_autogptq_declares_its_quantization_in_its_own_file(tmp_path: Path) -> None:
    assert declared_quantization(tmp_path, {}) is None
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    assert declared_quantization(tmp_path, {}) == {
        "quant_method": "gptq", "bits": 4, "group_size": 128,
    }  # fmt: skip
    stored = {"quant_method": "awq", "bits": 4}
    assert declared_quantization(tmp_path, {"quantization_config": stored}) == stored
