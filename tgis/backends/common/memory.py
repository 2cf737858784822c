"""An accelerator's memory as the KV pool's sizing sees it: its total, and the peak a piece of
work reaches. `CudaMemory` asks these of `torch.cuda` by default; given another object with
the same five calls (a fake of `torch.cuda`'s memory calls, in tests), the same code sizes a
pool on a machine without the device, so the sizing path runs in CI as it runs on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class CudaMemoryCalls(Protocol):
    """What `CudaMemory` calls of `torch.cuda`."""

    def synchronize(self, device: Any = None) -> None: ...

    def reset_peak_memory_stats(self, device: Any = None) -> None: ...

    def max_memory_allocated(self, device: Any = None) -> int: ...

    def mem_get_info(self, device: Any = None) -> tuple[int, int]: ...

    def empty_cache(self) -> None: ...


class DeviceMemory(Protocol):
    """An accelerator's memory: what the pool's sizing needs of it."""

    def total(self) -> int:
        """Bytes of the device."""
        ...

    def peak_of(self, work: Callable[[], object]) -> int:
        """Run `work` and return the most bytes allocated on the device while it ran (what
        was allocated before it included), the device idle on return; cached blocks go back
        after it."""
        ...


class CudaMemory:
    """`DeviceMemory` of one CUDA device, through `calls` (torch.cuda by default)."""

    def __init__(self, device: torch.device, calls: CudaMemoryCalls | None = None) -> None:
        self.device = device
        self.calls: CudaMemoryCalls = calls if calls is not None else torch.cuda  # type: ignore[assignment]

    def total(self) -> int:
        _free, total = self.calls.mem_get_info(self.device)
        return int(total)

    def peak_of(self, work: Callable[[], object]) -> int:
        calls = self.calls
        calls.synchronize(self.device)
        calls.reset_peak_memory_stats(self.device)
        try:
            work()
            calls.synchronize(self.device)
            return int(calls.max_memory_allocated(self.device))
        finally:
            calls.empty_cache()
