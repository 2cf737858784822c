"""Copies between the host and the device a step runs on, behind one seam (`copies`).

Host to device: through pinned memory with a non-blocking copy on an accelerator, so that the
host goes on preparing work instead of waiting for the copy (a copy from pageable memory makes
the host wait for the device to take it). PyTorch caches the pinned blocks and keeps each until
its copy is done, so per-step pinning allocates nothing after the first steps. On a CPU the
host tensor is the device tensor.

Device to host: `to_host` starts the copy and returns a `HostCopy`; its values are the
device's only once `wait()` returns (on CUDA the copy lands in pinned memory behind the
stream's work, and reading it before the stream reaches it reads whatever was there).

A step's many small host tensors (its block tables, slots, masks, token ids) go up together
(`to_device_all`): their bytes are packed into one staging buffer, pinned on an accelerator,
which one copy moves; the device tensors are views of that copy. One pinned allocation and one
copy a step, instead of one of each per tensor.

`COPIES` holds the copies of each device type. Tests put `StaleCopies` under "cpu" to run
the CPU engine with an accelerator's hazards: the device's tensor is not the host's (a change
to one after the copy does not reach the other), and a copy down reads stale values until
waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch


class HostCopy:
    """A device tensor's copy on its way to the host: `tensor` is where it lands, `wait()`
    returns it once it has."""

    def __init__(self, tensor: torch.Tensor, event: Any = None) -> None:
        self.tensor = tensor
        self._event = event

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.tensor


class Copies(Protocol):
    """How values cross between the host and one kind of device."""

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def to_device_all(
        self, hosts: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]: ...

    def to_host(self, tensor: torch.Tensor) -> HostCopy: ...


class HostCopies:
    """A CPU: the device is the host, nothing moves."""

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host

    def to_device_all(
        self, hosts: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        return list(hosts)

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        return HostCopy(tensor)


# Each tensor's bytes start at a multiple of this in a staging buffer (any dtype's alignment).
ALIGN = 16


def staging_layout(hosts: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Where each of `hosts` starts in one staging buffer, in bytes, and the buffer's size."""
    offsets, total = [], 0
    for host in hosts:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += host.numel() * host.element_size()
    return offsets, total


def pack(hosts: Sequence[torch.Tensor], staging: torch.Tensor, offsets: Sequence[int]) -> None:
    """Copy each of `hosts` into the uint8 buffer `staging` at its offset."""
    for host, at in zip(hosts, offsets, strict=True):
        size = host.numel() * host.element_size()
        staging[at : at + size].view(host.dtype).copy_(host.reshape(-1))


def unpack(
    flat: torch.Tensor, hosts: Sequence[torch.Tensor], offsets: Sequence[int]
) -> list[torch.Tensor]:
    """Views of the uint8 tensor `flat` (a packed buffer's copy) shaped as each of `hosts`."""
    return [
        flat[at : at + host.numel() * host.element_size()].view(host.dtype).view(host.shape)
        for host, at in zip(hosts, offsets, strict=True)
    ]


def _pinned(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


class AcceleratorCopies:
    """An accelerator: pinned, non-blocking copies up; a copy down waits for the device.
    `staging(size)`: a host uint8 buffer a copy up reads from (pinned; a double in tests)."""

    def __init__(self, staging: Callable[[int], torch.Tensor] = _pinned) -> None:
        self.staging = staging

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.pin_memory().to(device, non_blocking=True)

    def to_device_all(
        self, hosts: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        """`hosts` through one staging buffer and one copy (module doc). PyTorch keeps a
        pinned block from reuse until the copies that read it are done."""
        offsets, total = staging_layout(hosts)
        staging = self.staging(max(total, 1))
        pack(hosts, staging, offsets)
        return unpack(staging.to(device, non_blocking=True), hosts, offsets)

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        return HostCopy(tensor.to("cpu"))


class CudaCopies(AcceleratorCopies):
    """CUDA: pinned, non-blocking copies both ways; a copy down is complete at its event."""

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        landed = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        landed.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return HostCopy(landed, event)


class StaleCopies:
    """A CPU standing in for an accelerator's copies (tests): `to_device` gives the device
    its own copy, and `to_host` gives a `HostCopy` whose tensor holds stale values until
    `wait()`. `to_device_all` packs as an accelerator does, into a buffer whose bytes between
    the tensors are scribbled (a view at a wrong offset reads them). `fetched` counts the
    copies down, `sent` the copies up."""

    def __init__(self) -> None:
        self.fetched = 0
        self.sent = 0
        # Packs as an accelerator does, into a buffer scribbled first (0xFF: NaN, -1).
        self._packer = AcceleratorCopies(lambda n: torch.full((n,), 0xFF, dtype=torch.uint8))

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.sent += 1
        return host.clone()

    def to_device_all(
        self, hosts: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        self.sent += 1
        return self._packer.to_device_all(hosts, device)

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        self.fetched += 1
        return _StaleCopy(tensor.clone())


class _StaleCopy(HostCopy):
    def __init__(self, values: torch.Tensor) -> None:
        stale = torch.empty_like(values)
        _scribble(stale)
        super().__init__(stale)
        self._values = values

    def wait(self) -> torch.Tensor:
        self.tensor.copy_(self._values)
        return self.tensor


def _scribble(tensor: torch.Tensor) -> None:
    """Fill `tensor` with values no caller could mistake for its own."""
    if tensor.dtype.is_floating_point:
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.logical_not_()
    else:
        tensor.fill_(-(2**30) if tensor.element_size() >= 4 else -1)


COPIES: dict[str, Copies] = {"cpu": HostCopies(), "cuda": CudaCopies()}
_ACCELERATOR = AcceleratorCopies()


def copies(device: torch.device) -> Copies:
    """The copies of `device`'s type (another accelerator's: `AcceleratorCopies`)."""
    return COPIES.get(device.type, _ACCELERATOR)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`; the caller does not touch `host` after."""
    return copies(device).to_device(host, device)


def stays_on_host(device: torch.device) -> bool:
    """Whether a copy to `device` is the host tensor itself (a CPU's `HostCopies`)."""
    return isinstance(copies(device), HostCopies)


def host_to_device_all(hosts: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`hosts` (CPU tensors) on `device` in one copy (module doc); the caller does not touch
    them after."""
    return copies(device).to_device_all(hosts, device)


def to_device(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor of `dtype` on `device` (see `host_to_device`)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def to_host(tensor: torch.Tensor) -> HostCopy:
    """Start copying `tensor` to the host (see `HostCopy`)."""
    return copies(tensor.device).to_host(tensor)
