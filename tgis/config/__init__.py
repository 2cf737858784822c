"""The validation core: launcher flags + environment variables -> one frozen ServeConfig.

Its parts import one way, bottom to top:

- `parse` (one raw value -> a typed one), `dtypes` (the numeric-type table), `types` (the
  flags in, the configuration out), `model` (facts read from a model's config.json);
- `env`: environment variable names and defaults, the only reader and writer of the process
  environment, and `Sources` (flag > environment > default, with where each value came from);
- `rules` (shared by every backend), `static` (tpu and neuron shapes), `gaudi` (seed 003);
- `resolve`: `build_serve_config`, which applies them all.

This module re-exports what the rest of tgis uses; no part of the package imports it.
"""

from __future__ import annotations

from tgis.config.dtypes import CAST_TO_DTYPE, CAST_TYPES, DTYPES, dtype_bytes, normalize_dtype
from tgis.config.env import (
    DEFAULTS,
    DEMO_MODEL,
    ENV_NAMES,
    debug_enabled,
    default_env,
    model_reference,
    use_inductor_cache,
)
from tgis.config.model import ModelFacts, NeuronExport
from tgis.config.parse import flag, parse_bool, parse_int
from tgis.config.resolve import DetectBackend, build_serve_config
from tgis.config.rules import check_kv_budget
from tgis.config.types import (
    BACKENDS,
    PREFILL_MODES,
    STATIC_BACKENDS,
    GaudiSettings,
    LauncherArgs,
    ServeConfig,
    StaticShape,
)

__all__ = [
    "BACKENDS",
    "CAST_TO_DTYPE",
    "CAST_TYPES",
    "DEFAULTS",
    "DEMO_MODEL",
    "DTYPES",
    "ENV_NAMES",
    "PREFILL_MODES",
    "STATIC_BACKENDS",
    "DetectBackend",
    "GaudiSettings",
    "LauncherArgs",
    "ModelFacts",
    "NeuronExport",
    "ServeConfig",
    "StaticShape",
    "build_serve_config",
    "check_kv_budget",
    "debug_enabled",
    "default_env",
    "dtype_bytes",
    "flag",
    "model_reference",
    "normalize_dtype",
    "parse_bool",
    "parse_int",
    "use_inductor_cache",
]
