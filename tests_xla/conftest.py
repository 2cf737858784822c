"""The tpu backend on XLA:CPU: real torch-xla graphs compiled and run on this machine's CPU.

Runs in its own virtualenv (torch-xla 2.9.0 pins torch 2.9.0): `make test-xla`.
"""

from __future__ import annotations

import os

# Before torch_xla is imported anywhere: XLA on the CPU.
os.environ.setdefault("PJRT_DEVICE", "CPU")
