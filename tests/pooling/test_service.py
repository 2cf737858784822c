"""tgis.pooling.service: the device, dtype and batch limits a pooling model is loaded with for
each backend, the CUDA branch included (driven through a double of the model loader), and the
backends and sharding it refuses with the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tgis.pooling.service as service_module
from tests.server.conftest import make_config
from tgis.errors import ConfigError
from tgis.pooling.service import load_pooling_service
from tgis.pooling.spec import PoolingSpec

SPEC = PoolingSpec("embed", ("mean",), normalize=True)


class _Loaded:
    """What PoolingModel.load was asked for, standing in for the model."""

    packed = False

    def __init__(self, directory: Path, spec: PoolingSpec, device: Any, dtype: Any) -> None:
        self.args = (directory, spec, device, dtype)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_module.PoolingModel, "load", _Loaded)


@pytest.mark.parametrize(
    ("backend", "dtype", "device", "loaded_dtype"),
    [
        ("cuda", None, torch.device("cuda"), None),  # the checkpoint's own half dtype
        ("cuda", "bfloat16", torch.device("cuda"), torch.bfloat16),
        ("cpu", None, torch.device("cpu"), torch.float32),
        ("cpu", "bfloat16", torch.device("cpu"), torch.bfloat16),
    ],
)
def test_each_backend_loads_on_its_device_in_its_dtype_within_the_limits(
    loads: None, tmp_path: Path, backend: str, dtype: str | None, device: Any, loaded_dtype: Any
) -> None:
    config = make_config(
        backend=backend, dtype=dtype, max_batch_prefill_tokens=4096, max_batch_size=12
    )
    service = load_pooling_service(config, tmp_path, SPEC)
    assert service.model.args == (tmp_path, SPEC, device, loaded_dtype)  # type: ignore[attr-defined]
    assert (service.runner.max_batch_tokens, service.runner.max_batch_rows) == (4096, 12)
    assert not service.runner.running  # started by the server


def test_other_backends_and_shards_are_refused_with_the_fix(loads: None, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="served on cpu or cuda, not on the tpu backend"):
        load_pooling_service(make_config(backend="tpu"), tmp_path, SPEC)
    with pytest.raises(ConfigError, match="--num-shard 2: a pooling model is served by one"):
        load_pooling_service(make_config(num_shard=2), tmp_path, SPEC)
