"""The server under test: which API it speaks, the model it serves, and that model's tokenizer.

    target = detect_target("http://127.0.0.1:3000", api=None, api_key=None)
    tokenizer = load_tokenizer(None, target.model_id)   # never downloads

Detection: GET /info answering a JSON object with `model_id` means TGI's API (OpenAI's
embeddings when it says the model embeds: tgis's `task`, TEI's `model_type`); otherwise GET
/v1/models answering a model list means OpenAI's (chat completions by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tgis.benchmark.client import APIS
from tgis.errors import ConfigError, TgisError


@dataclass(frozen=True)
class Target:
    """A server to load: its base URL, API, and the model id it reports (None if it does not)."""

    url: str
    api: str
    model_id: str | None


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header of `--api-key` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _get_json(http: httpx.Client, path: str) -> Any:
    """The JSON body of GET `path`, or None when it fails with an HTTP error or is not JSON."""
    response = http.get(path)
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def detect_target(url: str, api: str | None, api_key: str | None, timeout: float = 10.0) -> Target:
    """Ask the server at `url` what it serves; `api` (when given) overrides the detected API.

    Raises TgisError when the server cannot be reached, or answers neither /info nor /v1/models
    and no --api was given.
    """
    if api is not None and api not in APIS:
        raise ConfigError(f"unknown --api {api!r}", f"choose one of {', '.join(APIS)}")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"--url {url!r} is not an http(s) URL", "e.g. --url http://127.0.0.1:3000"
        )
    base = url.rstrip("/")
    try:
        with httpx.Client(
            base_url=base, headers=auth_headers(api_key), timeout=timeout, trust_env=False
        ) as http:
            info = _get_json(http, "/info")
            if isinstance(info, dict) and isinstance(info.get("model_id"), str):
                # tgis's /info of an embedding model says its task (TEI's says model_type).
                embeds = info.get("task") == "embed" or "embedding" in str(info.get("model_type"))
                return Target(base, api or ("embeddings" if embeds else "tgi"), info["model_id"])
            models = _get_json(http, "/v1/models")
    except httpx.HTTPError as exc:
        raise TgisError(
            f"cannot reach the server at {base} ({type(exc).__name__}: {exc})",
            "check --url and that the server is running",
        ) from None
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list):
        ids = [m.get("id") for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        return Target(base, api or "openai-chat", ids[0] if ids else None)
    if api is None:
        raise TgisError(
            f"{base} answers neither GET /info (TGI) nor GET /v1/models (OpenAI)",
            f"pass --api ({', '.join(APIS)}) to load it anyway",
        )
    return Target(base, api, None)


def load_tokenizer(name: str | None, model_id: str | None) -> tuple[Any, str]:
    """The tokenizer `name` (--tokenizer), else the server's `model_id`, loaded from a local
    directory or the Hugging Face cache only (`local_files_only=True`: never downloads).

    Returns the tokenizer and the name it was loaded from; TgisError naming --tokenizer when
    neither can be loaded.
    """
    source = name or model_id
    if source is None:
        raise ConfigError(
            "the server does not report its model id, so its tokenizer is unknown",
            "pass --tokenizer PATH_OR_ID (a local directory or a model in the Hugging Face cache)",
        )
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        path = Path(source).expanduser()
        where = str(path) if path.is_dir() else source
        return AutoTokenizer.from_pretrained(where, local_files_only=True), where
    except (OSError, ValueError, KeyError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        flag = "--tokenizer" if name else "the server's model_id"
        raise ConfigError(
            f"cannot load the tokenizer {source!r} ({flag}) from a local directory or the "
            f"Hugging Face cache: {reason[:200]}",
            "pass --tokenizer PATH_OR_ID of a local tokenizer directory or a cached model "
            "(nothing is downloaded)",
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
