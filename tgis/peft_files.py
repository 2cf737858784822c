"""Reading a PEFT adapter's directory safely: `adapter_config.json`, and its weights from
`adapter_model.safetensors` or `adapter_model.bin` (the latter with
`torch.load(weights_only=True)`: reading an adapter never runs code from the file). Shared by
the prompt-prefix store (prompt tuning) and the LoRA adapter store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


class PeftFileError(Exception):
    """Why an adapter's files cannot be used (the reason part of a message)."""


def torch_load(path: Path) -> Any:
    """A torch file's contents, tensors only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable, not a torch file, or not weights only
        raise PeftFileError(f"cannot read {path.name} as tensors only: {exc}") from None


def read_config(path: Path, peft_type: str, what: str) -> dict[str, Any]:
    """The adapter's config, checked to be of `peft_type` (`what` names it in the message)."""
    try:
        config = json.loads((path / PEFT_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise PeftFileError(f"cannot read {PEFT_CONFIG}: {exc}") from None
    kind = config.get("peft_type") if isinstance(config, dict) else None
    if kind != peft_type:
        raise PeftFileError(f"the PEFT adapter is {kind!r}; {what} is a {peft_type} adapter")
    return config


def read_weights(path: Path) -> tuple[str, dict[str, Any]]:
    """The adapter's weights file name and its tensors by name."""
    weights = next((path / name for name in PEFT_WEIGHTS if (path / name).is_file()), None)
    if weights is None:
        raise PeftFileError(f"the PEFT adapter has neither {' nor '.join(PEFT_WEIGHTS)}")
    if weights.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state: Any = load_file(weights)
        except (OSError, SafetensorError) as exc:
            raise PeftFileError(f"cannot read {weights.name}: {exc}") from None
    else:
        state = torch_load(weights)
    if not isinstance(state, dict):
        raise PeftFileError(f"{weights.name} holds a {type(state).__name__}, not named tensors")
    return weights.name, state
