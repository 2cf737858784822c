"""Backend names and `--backend auto`: pick the device this machine actually has."""

from __future__ import annotations

import importlib.util

from tgis.config import ModelFacts


def has_module(name: str) -> bool:
    """Whether `name` is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def detect_backend(facts: ModelFacts, pjrt_device: str | None = None) -> str:
    """The backend `auto` resolves to, most specific first.

    A Neuron-exported model can only run on neuron. Otherwise: a TPU runtime (torch-xla with
    PJRT_DEVICE=TPU, which the validation core passes as `pjrt_device`), Gaudi
    (habana_frameworks), CUDA (torch.cuda.is_available()), else cpu.
    XLA on CPU is never chosen automatically: ask for it with --backend tpu.
    """
    if facts.neuron is not None:
        return "neuron"
    if (pjrt_device or "").upper() == "TPU" and has_module("torch_xla"):
        return "tpu"
    if has_module("habana_frameworks"):
        return "gaudi"
    if has_module("torch"):
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"
