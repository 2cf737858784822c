"""What the torch backends need to know of the machine: dtype, CPU threads, free memory; and
loading a causal LM onto it.

No environment variables are read here (tgis.config.env owns them); everything comes from
torch, /proc and /sys.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tgis.backends.common.gemm import decode_matmul_seconds
from tgis.config import DTYPES
from tgis.config.checkpoint_quant import (
    checkpoint_scheme,
    declared_quantization,
    vision_checkpoint_refusal,
)
from tgis.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from tgis.vision.encoder import VisionEncoder

logger = logging.getLogger(__name__)

# Fraction of the memory free after loading the model that the KV cache may take. CPU memory
# is shared with the OS, the server and prefill activations; a GPU's is the backend's own.
KV_MEMORY_FRACTION = {"cpu": 0.5, "cuda": 0.85}


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bfloat16 in hardware (AVX512-BF16 or AMX), so bf16
    matmuls are fast rather than emulated."""
    try:
        if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
            return True
    except AttributeError:  # private helpers moved: fall back to the kernel's view
        pass
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical name (tgis.config.DTYPES)."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


# The dtypes the CPU dtype probe times (on common/gemm.py's decode-shaped matmuls).
PROBE_DTYPES = (torch.float32, torch.bfloat16)


def layer_shape(config: Mapping[str, Any]) -> tuple[int, int]:
    """(hidden, intermediate) of a model's (text) config.json fields, what the dtype probe
    times: llama-style names, T5's d_model / d_ff, else a 4x MLP."""
    hidden = int(config.get("hidden_size") or config.get("d_model") or 2048)
    intermediate = int(config.get("intermediate_size") or config.get("d_ff") or 4 * hidden)
    return hidden, intermediate


def resolve_dtype(
    device: torch.device,
    requested: str | None,
    model_dtype: object,
    probe_shape: tuple[int, int] = (2048, 5632),
) -> torch.dtype:
    """The dtype to load the model in.

    CPU: float32 where the CPU has no native bf16 (emulated bf16 or fp16 matmuls are several
    times slower); bfloat16 where it has (AVX512-BF16 / AMX) and bfloat16 was asked for; with
    no dtype asked for, whichever of the two `choose_cpu_dtype` measures faster on this CPU
    for a layer of `probe_shape` (hidden, intermediate): native bf16 is not always faster.
    CUDA: what was asked for, else the checkpoint's half-precision dtype, else bfloat16 where
    supported, else float16.
    """
    if requested is not None:
        torch_dtype(requested)  # refuse unknown names on every device
    if device.type == "cpu":
        if requested == "bfloat16" and cpu_has_native_bf16():
            return torch.bfloat16
        if requested is None:
            chosen, why = choose_cpu_dtype(*probe_shape)
            logger.info("dtype auto: %s (%s)", str(chosen).removeprefix("torch."), why)
            return chosen
        return torch.float32
    if requested is not None:
        return torch_dtype(requested)
    if model_dtype in (torch.float16, torch.bfloat16):
        return model_dtype  # type: ignore[return-value]
    if isinstance(model_dtype, str) and model_dtype in ("float16", "bfloat16"):
        return torch_dtype(model_dtype)
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def choose_cpu_dtype(hidden: int, intermediate: int) -> tuple[torch.dtype, str]:
    """float32 or bfloat16 for a model whose layers are `hidden` wide with an MLP of
    `intermediate`, and why. Without native bf16: float32. With it: each dtype runs a
    decoder layer's matmuls (q/k/v/o and the MLP) at decode's batch sizes (gemm.PROBE_BATCHES),
    on this thread and its OpenMP team; bf16 is chosen only where its total time is lower."""
    if not cpu_has_native_bf16():
        return torch.float32, "this CPU has no native bfloat16 (AVX512-BF16 or AMX)"
    times = {dtype: decode_matmul_seconds(dtype, hidden, intermediate) for dtype in PROBE_DTYPES}
    f32, bf16 = times[torch.float32], times[torch.bfloat16]
    measured = f"decode-shaped matmuls: bfloat16 {bf16 * 1e3:.2f} ms, float32 {f32 * 1e3:.2f} ms"
    if bf16 < f32:
        return torch.bfloat16, f"{measured}; bfloat16 is {f32 / bf16:.2f}x faster here"
    return torch.float32, f"{measured}; native bfloat16 is {bf16 / f32:.2f}x slower here"


def cpu_threads() -> int:
    """CPU cores this process may use: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    for path, parse in (
        (Path("/sys/fs/cgroup/cpu.max"), _quota_v2),
        (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _quota_v1),
    ):
        try:
            quota = parse(path)
        except (OSError, ValueError):
            continue
        if quota is not None:
            cores = min(cores, max(1, math.ceil(quota)))
            break
    return max(1, cores)


def _quota_v2(path: Path) -> float | None:
    quota, period = path.read_text().split()[:2]
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(path: Path) -> float | None:
    quota = int(path.read_text())
    period = int((path.parent / "cpu.cfs_period_us").read_text())
    return None if quota <= 0 else quota / period


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache: MemAvailable on CPU, free device memory on CUDA."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise RuntimeError("cannot measure free memory (no /proc/meminfo): pass kv_tokens")


def _prepare(
    model_dir: Path, device: torch.device, dtype: str | None, num_threads: int | None
) -> tuple[Any, torch.dtype]:
    """The model's transformers config and the dtype to load it in; the CPU's threads set."""
    from transformers import AutoConfig

    if device.type == "cpu":
        torch.set_num_threads(num_threads or cpu_threads())
    elif device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA is not available on this machine", "use --backend cpu")
    config = AutoConfig.from_pretrained(model_dir)
    shape = layer_shape(config.get_text_config().to_dict())
    chosen = resolve_dtype(device, dtype, getattr(config, "dtype", None), shape)
    if dtype is not None and chosen != getattr(torch, dtype):
        logger.warning("dtype %s is emulated on this CPU: using %s", dtype, chosen)
    return config, chosen


def load_model(
    model_dir: Path, device: torch.device, dtype: str | None, num_threads: int | None = None
) -> tuple[PreTrainedModel, VisionEncoder | None]:
    """The causal LM in `model_dir` (as `load_causal_lm`), or a vision-language model's
    language model with its vision encoder (tgis.vision.encoder); a ConfigError for a
    pre-quantized vision-language checkpoint (`vision_checkpoint_refusal`)."""
    from tgis.vision.families import vision_family_of

    config = json.loads((model_dir / "config.json").read_text())
    if vision_family_of(config) is None:
        return load_causal_lm(model_dir, device, dtype, num_threads), None
    declared = declared_quantization(model_dir, config)
    if declared is not None:
        method = declared.get("quant_method") if isinstance(declared, dict) else None
        raise vision_checkpoint_refusal(config.get("model_type"), method)
    from tgis.vision.encoder import load_vision_lm

    loaded, chosen = _prepare(model_dir, device, dtype, num_threads)
    return load_vision_lm(model_dir, loaded, device, chosen)


def load_causal_lm(
    model_dir: Path,
    device: torch.device,
    dtype: str | None,
    num_threads: int | None = None,
    seq2seq: bool = False,
) -> PreTrainedModel:
    """The causal LM (`seq2seq`: the encoder-decoder model) in `model_dir` on `device`, in
    eval mode, in the dtype `resolve_dtype` picks (float32 on CPUs without native bf16). On
    CPU, torch's intra-op threads are set process-wide to `num_threads`, by default the cores
    this process may use (affinity and cgroup quota): one thread per core is fastest for the
    matmul-bound forward."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config, chosen = _prepare(model_dir, device, dtype, num_threads)
    scheme = None if seq2seq else checkpoint_scheme(model_dir, config.to_dict())
    if scheme is not None:
        # A pre-quantized checkpoint: its projections read as stored, for the paged forward.
        from tgis.backends.common.quant_checkpoint import load_quantized

        return load_quantized(model_dir, config, device, chosen, scheme)
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=chosen)
    return model.to(device).eval()
