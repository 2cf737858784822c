"""Host values to the device a step runs on: through pinned memory with a non-blocking copy on
an accelerator, so that the host goes on preparing work instead of waiting for the copy (a
copy from pageable memory makes the host wait for the device to take it). On a CPU the host
tensor is the device tensor. PyTorch caches the pinned blocks and keeps each until its copy
is done, so per-step pinning allocates nothing after the first steps."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_device(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor of `dtype` on `device` (see `host_to_device`)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)
