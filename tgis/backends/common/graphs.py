"""How a device records a step once and replays it: the one interface CUDA graphs (the paged
engine's decode) and HPU graphs (the fixed-shape forward) share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class GraphApi(Protocol):
    """How one device records and replays a step."""

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Record `step` (which reads the captured input tensors) and return the graph and the
        output tensor it writes, holding the step's result for the current inputs."""
        ...

    def replay(self, graph: Any) -> None:
        """Run a recorded graph again on the current contents of its input tensors."""
        ...
