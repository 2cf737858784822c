"""Environment variables: their names, their defaults, and the one place that reads or sets them.

Flags win over environment variables; environment variables use the names of TGI's launcher
(MODEL_ID, MAX_TOTAL_TOKENS, ...) and of the accelerator images. Everything else in tgis gets
its settings from a ServeConfig, or from a mapping this module hands out (`default_env`), so
tests never touch os.environ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from tgis.config.parse import flag, parse_bool, parse_float, parse_int
from tgis.config.types import LauncherArgs

# Environment fallback of each flag (TGI launcher names), and its default when neither is set.
ENV_NAMES: dict[str, str] = {f.name: f.name.upper() for f in fields(LauncherArgs)}
ENV_NAMES["backend"] = "TGIS_BACKEND"
ENV_NAMES["prefill_mode"] = "TGIS_PREFILL_MODE"
ENV_NAMES["model_impl"] = "TGIS_MODEL_IMPL"
ENV_NAMES["attention_backend"] = "TGIS_ATTENTION_BACKEND"
ENV_NAMES["compile_cache"] = "TGIS_COMPILE_CACHE"
ENV_NAMES["compile"] = "TGIS_COMPILE"
ENV_NAMES["cuda_graphs"] = "TGIS_CUDA_GRAPHS"
ENV_NAMES["async_scheduling"] = "TGIS_ASYNC_SCHEDULING"
ENV_NAMES["grpc"] = "TGIS_GRPC"
ENV_NAMES["playground"] = "TGIS_PLAYGROUND"
ENV_NAMES["allow_image_urls"] = "TGIS_ALLOW_IMAGE_URLS"
ENV_NAMES["socket_ifname"] = "TGIS_SOCKET_IFNAME"
ENV_NAMES["join_timeout_s"] = "TGIS_JOIN_TIMEOUT_S"
ENV_NAMES["node_timeout_s"] = "TGIS_NODE_TIMEOUT_S"
ENV_NAMES["rerank_tokens"] = "TGIS_RERANK_TOKENS"
ENV_NAMES["rerank_template"] = "TGIS_RERANK_TEMPLATE"
# Other launchers' names of a setting (alias -> the field it sets): TGI 1.x's
# --max-input-length and TGIS's flags and variables, so a deployment's settings move over as
# they are. Giving both names of one setting is an error.
ALIASES: dict[str, str] = {
    "max_input_length": "max_input_tokens",
    "model_name": "model_id",
    "max_sequence_length": "max_total_tokens",
    "dtype_str": "dtype",
}
DEFAULTS: dict[str, Any] = {
    "max_concurrent_requests": 128,
    "max_best_of": 2,
    "max_stop_sequences": 4,
    "max_top_n_tokens": 5,
    "backend": "auto",
    "port": 3000,
    "hostname": "0.0.0.0",
    "grpc_port": 8033,
    "max_new_tokens": 1024,
    "master_addr": "127.0.0.1",
    "master_port": 29500,
    "nnodes": 1,
    "node_rank": 0,
    "join_timeout_s": 600.0,
    "node_timeout_s": 30.0,
    "max_request_body_bytes": 2_000_000,
    "max_stored_responses": 1000,
    "max_images_per_request": 8,
    "max_image_pixels": 4096 * 4096,
    "max_image_bytes": 20_000_000,
    "header_timeout_s": 10.0,
    "body_timeout_s": 60.0,
    "keep_alive_timeout_s": 5.0,
    "max_loras": 8,
    "max_lora_rank": 64,
}
# The bundled model `tgis serve` runs when no --model-id / MODEL_ID is given.
DEMO_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "demo-model")


def default_env() -> Mapping[str, str]:
    """The process environment; callers pass it explicitly so the core stays testable."""
    return os.environ


def use_inductor_cache(directory: Path, env: MutableMapping[str, str] | None = None) -> None:
    """Point torch inductor's FX graph and kernel caches at `directory` (--compile-cache).

    Inductor reads TORCHINDUCTOR_CACHE_DIR at its first compilation, so this must run before
    the first torch.compile'd call.
    """
    (os.environ if env is None else env)["TORCHINDUCTOR_CACHE_DIR"] = str(directory.resolve())


def set_variables(values: Mapping[str, str], env: MutableMapping[str, str] | None = None) -> None:
    """Set variables a library reads from the process environment when it starts (gloo's and
    NCCL's socket interface)."""
    (os.environ if env is None else env).update(values)


def debug_enabled(env: Mapping[str, str] | None = None) -> bool:
    """TGIS_DEBUG=1 makes the CLI show tracebacks."""
    return parse_bool("TGIS_DEBUG", (env or os.environ).get("TGIS_DEBUG", "0"))


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """The stripped value of `name`; None when unset or blank."""
    raw = env.get(name)
    return None if raw is None or raw.strip() == "" else raw.strip()


def env_int(env: Mapping[str, str], name: str, minimum: int | None = 1) -> int | None:
    """An integer variable, checked by parse_int; None when unset or blank."""
    raw = env_value(env, name)
    return None if raw is None else parse_int(name, raw, minimum)


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env_value(env, name)
    return default if raw is None else parse_bool(name, raw)


def model_reference(args: LauncherArgs, env: Mapping[str, str]) -> tuple[str, str | None]:
    """(model id, revision) from --model-id/MODEL_ID and --revision/REVISION; the demo model by default."""
    model_id = (
        args.model_id
        or args.model_name
        or env_value(env, "MODEL_ID")
        or env_value(env, "MODEL_NAME")
        or DEMO_MODEL
    )
    revision = args.revision or env_value(env, "REVISION")
    return model_id, revision


class Sources:
    """Flag > environment variable > default, remembering where each value came from."""

    def __init__(self, args: LauncherArgs, env: Mapping[str, str]) -> None:
        self.args, self.env = args, env
        self.origin: dict[str, str] = {}
        # Settings given through an alias: field -> the alias's flag or variable.
        self.names: dict[str, str] = {}

    def get(self, name: str) -> Any:
        value = getattr(self.args, name)
        if value is not None:
            self.origin[name] = "flag"
            return value
        env_name = ENV_NAMES[name]
        raw = env_value(self.env, env_name)
        if raw is None:
            return None
        self.origin[name] = "env"
        kind = str(LauncherArgs.__dataclass_fields__[name].type)
        if "bool" in kind:
            return parse_bool(env_name, raw)
        if "int" in kind:
            return parse_int(env_name, raw, minimum=None)
        if "float" in kind:
            return parse_float(env_name, raw)
        return raw

    def spelled(self, name: str) -> str | None:
        """The flag or variable that set `name` (`--max-total-tokens`, `MAX_TOTAL_TOKENS`)."""
        how = self.origin.get(name)
        if how is None:
            return None
        if name in self.names:
            return self.names[name]
        return ENV_NAMES[name] if how == "env" else flag(name)

    def given(self, name: str) -> bool:
        return name in self.origin

    def label(self, name: str, value: Any) -> str:
        """How to name a value in a message: `--flag 12`, `ENV=12`, or `--flag (derived: 12)`."""
        spelled = self.spelled(name)
        if spelled is None:
            return f"{flag(name)} (derived: {value})"
        return f"{spelled}={value}" if self.origin[name] == "env" else f"{spelled} {value}"
