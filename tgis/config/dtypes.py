"""The one table of numeric types: the names tgis accepts, Neuron's cast names, element sizes.

Backends map a name to their framework's type (tgis.backends.common.device.torch_dtype); the
names, aliases and sizes live only here.
"""

from __future__ import annotations

from tgis.errors import ConfigError

# The canonical names, as torch spells them (torch.float32 ...).
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_ALIASES = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# optimum-neuron's auto_cast_type names and the dtype each one computes in.
CAST_TO_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
CAST_TYPES = tuple(CAST_TO_DTYPE)


def normalize_dtype(raw: str | None, source: str = "--dtype") -> str | None:
    """A canonical dtype name from any alias (fp16, half, bf16, ...); None stays None."""
    if raw is None:
        return None
    dtype = DTYPE_ALIASES.get(raw.strip().lower())
    if dtype is None:
        raise ConfigError(
            f"{source} {raw!r} is not a supported dtype", f"use one of {', '.join(DTYPES)}"
        )
    return dtype


def _known(name: object) -> str | None:
    """The canonical name of a dtype name, alias or torch spelling ("torch.float16"), if any."""
    return DTYPE_ALIASES.get(str(name).strip().lower().removeprefix("torch."))


def cast_type(raw: object) -> object:
    """A Neuron cast name from a dtype name or alias (bfloat16 -> bf16); other values unchanged."""
    dtype = _known(raw) if isinstance(raw, str) else None
    if dtype is None:
        return raw
    return next(cast for cast, name in CAST_TO_DTYPE.items() if name == dtype)


def dtype_bytes(name: object, default: int = 2) -> int:
    """Bytes per element of a dtype name or alias ("torch.float16" too); `default` if unknown."""
    dtype = _known(name)
    return DTYPE_BYTES[dtype] if dtype else default
