"""What the paged backend does differently by device, in one place: the KV block size, the
prefill chunk a step takes at most, how the pool is sized (from the host's available memory,
or from an accelerator's memory after a profiling forward) and the MLP's weight layout.

`device_traits` gives a device's own. `cuda_traits` gives CUDA's for any device: on a CPU, with
a fake of `torch.cuda`'s memory calls (`tgis.backends.common.memory`), it runs the CUDA
configuration (blocks of 256, no chunk cap, the profiled pool, gate and up fused) where CI
runs, so the code a GPU takes is the code the tests take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgis.backends.common.device import KV_MEMORY_FRACTION
from tgis.backends.common.memory import CudaMemory, CudaMemoryCalls, DeviceMemory
from tgis.backends.models.decoder import FUSE_GATE_UP

# Tokens per KV block. CUDA's attention kernels read a paged cache in pages of 256 tokens;
# the plain-torch path gathers any size, and small blocks share prompt prefixes more finely.
CUDA_BLOCK_SIZE = 256
CPU_BLOCK_SIZE = 16
# Tokens one CPU step prefills at most: a CPU prefill is compute-bound from a few hundred
# tokens on, so larger chunks only delay the decodes sharing the step.
CPU_PREFILL_STEP_TOKENS = 512
# Float32 prompt logits one CUDA step may hold (1,046 positions of a 128k vocabulary, 8,192 of
# a 16k one): with no cap on a prefill step, logits at all of a 128k-token step's positions
# would be 67 GB for a 128k vocabulary, which the pool's sizing would have to leave free.
CUDA_PROMPT_LOGIT_BYTES = 512 * 2**20


@dataclass(frozen=True)
class DeviceTraits:
    """How the paged backend runs on one kind of device."""

    block_size: int
    # The most prompt tokens one step computes (None: the scheduler's prefill budget).
    prefill_step_tokens: int | None
    # An accelerator's memory: the pool takes `kv_memory_fraction` of it less the weights and
    # a profiled forward's peak. None: `kv_memory_fraction` of the host's available memory.
    memory: DeviceMemory | None
    kv_memory_fraction: float
    # The MLP's gate and up projections as one matmul (models/decoder.py's FUSE_GATE_UP).
    fuse_gate_up: bool = False
    # Bytes of float32 prompt logits ([positions, vocab]) one step may return: prompts that
    # want logprobs are prefilled in chunks of at most this many bytes' rows, and the profiled
    # step holds that many, not a logit row for every prefill token. None: no cap.
    prompt_logit_bytes: int | None = None
    # Whether `--attention-backend auto` attends with tgis's Triton kernels where they run
    # (racing them against flash attention at warmup where that runs too).
    triton_attention: bool = False

    def prompt_logit_tokens(self, vocab_size: int, prefill_chunk: int) -> int | None:
        """The prompt positions one step returns logits for at most (None: no cap)."""
        if self.prompt_logit_bytes is None:
            return None
        return max(1, min(prefill_chunk, self.prompt_logit_bytes // (4 * vocab_size)))


def cuda_traits(device: torch.device, calls: CudaMemoryCalls | None = None) -> DeviceTraits:
    """CUDA's traits, its memory read through `calls` (torch.cuda by default)."""
    return DeviceTraits(
        CUDA_BLOCK_SIZE,
        None,
        CudaMemory(device, calls),
        KV_MEMORY_FRACTION["cuda"],
        FUSE_GATE_UP["cuda"],
        CUDA_PROMPT_LOGIT_BYTES,
        triton_attention=True,
    )


def device_traits(device: torch.device) -> DeviceTraits:
    """The traits of `device`'s own kind."""
    if device.type == "cuda":
        return cuda_traits(device)
    return DeviceTraits(
        CPU_BLOCK_SIZE,
        CPU_PREFILL_STEP_TOKENS,
        None,
        KV_MEMORY_FRACTION.get(device.type, KV_MEMORY_FRACTION["cpu"]),
        FUSE_GATE_UP.get(device.type, False),
    )
