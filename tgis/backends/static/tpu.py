"""Load the tpu backend: a llama-family model on a torch-xla device over the static batch.

The shape is the validated config's static shape (HF_BATCH_SIZE x HF_SEQUENCE_LENGTH, or the
flags); prefill is `insert` unless --prefill-mode rebuild asks for the seeds' full rebuild.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tgis.backends.static.batch import StaticBatchBackend, pad_token_id
from tgis.backends.static.buckets import static_policy
from tgis.backends.static.xla import XlaOps, import_xla, initialize_compile_cache
from tgis.config import ServeConfig
from tgis.errors import ConfigError

logger = logging.getLogger(__name__)


def tpu_dtype(requested: str | None, platform: str) -> torch.dtype:
    """bfloat16 on a TPU (its native type) unless asked otherwise; float32 on XLA:CPU, whose
    bf16 is emulated."""
    if requested is not None:
        return getattr(torch, requested)
    return torch.bfloat16 if platform == "TPU" else torch.float32


def load_tpu_backend(config: ServeConfig, model_dir: Path) -> StaticBatchBackend:
    """Load `model_dir` onto the XLA device with `config`'s static shape (see module doc)."""
    import_xla()
    from transformers import AutoModelForCausalLM

    from tgis.backends.static.kv import StaticLlamaForward

    shape = config.static_shape
    if shape is None:
        raise ConfigError("the tpu backend needs a static shape", "resolve the config for tpu")
    initialize_compile_cache(Path(config.compile_cache) if config.compile_cache else None)
    ops = XlaOps()
    if config.compile_cache and ops.platform() == "CPU":
        logger.warning(
            "XLA:CPU writes compiled programs to %s but cannot load them back (its PJRT client "
            "has no executable deserialization): each process compiles again; a TPU loads them",
            config.compile_cache,
        )
    dtype = tpu_dtype(config.dtype, ops.platform())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(ops.device)
    forward = StaticLlamaForward(model, shape.batch_size, shape.sequence_length)
    mode = config.prefill_mode or "insert"
    policy = static_policy(
        shape.batch_size,
        shape.sequence_length,
        config.max_input_tokens,
        mode,  # type: ignore[arg-type]
    )
    logger.info(
        "tpu backend on %s (%s, %s): static batch %d x %d, %s prefill, %d shapes to compile",
        ops.platform(),
        ops.device,
        dtype,
        shape.batch_size,
        shape.sequence_length,
        mode,
        len(policy.warmup_plan(config.max_input_tokens)),
    )
    return StaticBatchBackend(forward, policy, ops, "tpu", pad_token_id(model.config), dtype)
