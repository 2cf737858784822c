"""A pooling model served by `tgis serve`: loaded for the configured device and dtype, with
its batching runner sized by the same launcher limits as generation's steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tgis.config import ServeConfig
from tgis.errors import ConfigError
from tgis.pooling.model import PoolingModel
from tgis.pooling.runner import PoolingRunner
from tgis.pooling.spec import PoolingSpec


@dataclass(frozen=True)
class PoolingService:
    model: PoolingModel
    runner: PoolingRunner


def load_pooling_service(config: ServeConfig, model_dir: Path, spec: PoolingSpec) -> PoolingService:
    """The model on cpu or cuda in --dtype (float32 on a CPU, the checkpoint's on a GPU, when
    not given), its runner's batches within --max-batch-prefill-tokens and the batch's rows
    (--max-batch-size, else --max-concurrent-requests). The runner is not started."""
    if config.backend not in ("cpu", "cuda"):
        raise ConfigError(
            f"a {spec.task} model (a pooling model) is served on cpu or cuda, not on the "
            f"{config.backend} backend",
            "serve it with --backend cpu or cuda",
        )
    if config.num_shard > 1:
        raise ConfigError(
            f"--num-shard {config.num_shard}: a pooling model is served by one process",
            "drop --num-shard",
        )
    device = torch.device("cuda" if config.backend == "cuda" else "cpu")
    dtype = getattr(torch, config.dtype) if config.dtype else None
    if dtype is None and device.type == "cpu":
        dtype = torch.float32
    model = PoolingModel.load(model_dir, spec, device, dtype)
    runner = PoolingRunner(model, config.max_batch_prefill_tokens, config.batch_slots)
    return PoolingService(model, runner)
