"""Backend names and `--backend auto`: pick the device this machine actually has."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from tgis.config import ModelFacts


def has_module(name: str) -> bool:
    """Whether `name` is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def detect_backend(facts: ModelFacts, env: Mapping[str, str] | None = None) -> str:
    """The backend `auto` resolves to, most specific first.

    A Neuron-exported model can only run on neuron. Otherwise: a TPU runtime (torch-xla with
    PJRT_DEVICE=TPU), Gaudi (habana_frameworks), CUDA (torch.cuda.is_available()), else cpu.
    XLA on CPU is never chosen automatically: ask for it with --backend tpu.
    """
    env = os.environ if env is None else env
    if facts.neuron is not None:
        return "neuron"
    if env.get("PJRT_DEVICE", "").upper() == "TPU" and has_module("torch_xla"):
        return "tpu"
    if has_module("habana_frameworks"):
        return "gaudi"
    if has_module("torch"):
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"
