"""tgis.engine.transfer: a step's host tensors go up in one copy through one staging buffer,
each tensor at an aligned offset, and come back equal whatever their dtype and shape; the
bytes between them are scribbled in the test double, so a view at a wrong offset shows."""

from __future__ import annotations

import pytest
import torch

from tgis.backends.paged.attention import StepMetadata, _gather_tensors, step_metadata
from tgis.engine import transfer
from tgis.engine.transfer import ALIGN, AcceleratorCopies, StaleCopies, staging_layout

CPU = torch.device("cpu")


def hosts() -> list[torch.Tensor]:
    """Tensors of every kind a step sends: odd sizes, so offsets need rounding."""
    return [
        torch.tensor([3, 1, 4], dtype=torch.long),
        torch.tensor([0, 5, 9], dtype=torch.int32)[:3],
        torch.tensor([[True, False, True]]).view(1, 1, 1, 3),
        torch.empty(0, dtype=torch.long),
        torch.arange(12, dtype=torch.int32).view(3, 4).t(),  # not contiguous
        torch.tensor([1.5, float("-inf")], dtype=torch.float32),
    ]


def test_the_layout_aligns_every_tensor() -> None:
    offsets, total = staging_layout(hosts())
    assert offsets == [0, 32, 48, 64, 64, 112] and total == 120
    assert all(at % ALIGN == 0 for at in offsets)


@pytest.mark.parametrize(
    "copies",
    [StaleCopies(), AcceleratorCopies(staging=lambda n: torch.full((n,), 0xFF, dtype=torch.uint8))],
    ids=["stale", "accelerator"],
)
def test_every_tensor_comes_back_equal_in_one_copy(copies: transfer.Copies) -> None:
    sent = copies.to_device_all(hosts(), CPU)
    for host, device in zip(hosts(), sent, strict=True):
        assert device.dtype == host.dtype and device.shape == host.shape
        assert torch.equal(device, host)
    if isinstance(copies, StaleCopies):
        assert copies.sent == 1
        # The device's copy is its own: a change to the host after does not reach it.
        original = hosts()
        again = copies.to_device_all(original, CPU)
        original[0].fill_(7)
        assert again[0].tolist() == [3, 1, 4]


def test_a_steps_metadata_goes_up_in_one_copy_and_equals_the_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mixed step (a prefill run, decode rows, a sliding window and the caller's inputs):
    built under an accelerator's copies it is sent once, and every tensor equals the one the
    CPU builds."""
    args = ([3, 1, 1], [3, 9, 6], [[0], [1, 2, 3], [4, 5]], 4, CPU, [None, 4], 8, 2)
    inputs = torch.arange(5)
    on_host = step_metadata(*args, inputs=inputs)
    stale = StaleCopies()
    monkeypatch.setitem(transfer.COPIES, "cpu", stale)
    sent = step_metadata(*args, inputs=inputs)
    assert stale.sent == 1 and isinstance(sent, StepMetadata)
    expected: list[torch.Tensor] = []
    got: list[torch.Tensor] = []
    _gather_tensors(on_host, expected)
    _gather_tensors(sent, got)
    assert len(got) == len(expected) > 8
    for a, b in zip(expected, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert a.data_ptr() != b.data_ptr()
    assert sent.decode is not None and set(sent.decode.masks) == {None, 4}
    assert len(sent.prefill) == 1 and sent.inputs is not None


def test_a_paged_step_sends_its_inputs_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the paged backend with an accelerator's copies (scribbled padding, the
    device's own copy): one copy up a step, prefill and decode, and the CPU's tokens."""
    from tests.backends.paged_driver import greedy, paged
    from tests.factories import tiny_model

    prompts = ((5, 17, 42, 99, 7), (100, 11), (3, 4, 5, 6, 7, 8, 9, 10, 11))
    expected = greedy(paged(tiny_model("llama", seed=3)), prompts, 5)
    stale = StaleCopies()
    monkeypatch.setitem(transfer.COPIES, "cpu", stale)
    backend = paged(tiny_model("llama", seed=3))
    steps = []
    forward = backend.forward
    monkeypatch.setattr(backend, "forward", lambda items: steps.append(1) or forward(items))
    assert greedy(backend, prompts, 5) == expected
    assert stale.sent == len(steps) == 5  # one prefill, four decodes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_steps_tensors_go_up_in_one_pinned_copy() -> None:
    """CUDA's copies: every tensor lands on the device equal to its host, through one pinned
    staging buffer, and a step's metadata built there equals the CPU's."""
    cuda = torch.device("cuda")
    sent = transfer.copies(cuda).to_device_all(hosts(), cuda)
    torch.cuda.synchronize()
    for host, device in zip(hosts(), sent, strict=True):
        assert device.is_cuda and device.dtype == host.dtype and device.shape == host.shape
        assert torch.equal(device.cpu(), host)
    args = ([3, 1, 1], [3, 9, 6], [[0], [1, 2, 3], [4, 5]], 4)
    rest = ([None, 4], 8, 2)
    on_host = step_metadata(*args, CPU, *rest, inputs=torch.arange(5))
    on_cuda = step_metadata(*args, cuda, *rest, inputs=torch.arange(5))
    expected: list[torch.Tensor] = []
    got: list[torch.Tensor] = []
    _gather_tensors(on_host, expected)
    _gather_tensors(on_cuda, got)
    assert all(t.is_cuda for t in got) and len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b.cpu())
