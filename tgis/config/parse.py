"""The bottom of the validation core: turning one raw value into a typed one, or a ConfigError.

Nothing here knows a flag's meaning; every other part of tgis.config builds on these.
"""

from __future__ import annotations

from tgis.errors import ConfigError


def parse_bool(name: str, raw: str) -> bool:
    """true/false, 1/0, yes/no, on/off (any case); an empty value is false."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean", f"set {name} to true or false")


def parse_int(name: str, raw: str, minimum: int | None = 1) -> int:
    """A whole number, at least `minimum` (None: any)."""
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not an integer", f"set {name} to a whole number"
        ) from None
    if minimum is not None and value < minimum:
        raise ConfigError(
            f"{name}={value} must be >= {minimum}", f"set {name} to {minimum} or more"
        )
    return value


def parse_float(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number", f"set {name} to a number") from None


def flag(name: str) -> str:
    """The command-line flag of a LauncherArgs field: max_total_tokens -> --max-total-tokens."""
    return "--" + name.replace("_", "-")
