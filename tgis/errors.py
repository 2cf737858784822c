"""The project's error types. Commands raise these; the CLI turns them into one line."""

from __future__ import annotations


class TgisError(Exception):
    """An error the user can act on: the message names what is wrong and how to fix it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ConfigError(TgisError):
    """A launcher flag, environment variable or model configuration that cannot be served."""


class InputValidationError(TgisError):
    """A request whose parameters or inputs break the server's limits (HTTP 422)."""


class ModelNotFoundError(TgisError):
    """A model id that is neither a local directory nor in the Hub cache / on the Hub."""


class ModelNotCachedError(ModelNotFoundError):
    """A Hub model id whose snapshot is not in the local Hugging Face cache."""


class HubError(TgisError):
    """The Hub refused or failed a request (gated repo, missing file, network)."""


class ConversionError(TgisError):
    """Weights that could not be converted or did not verify after conversion."""


class BackendUnavailableError(TgisError):
    """A backend whose device runtime or SDK is not installed on this machine."""


class OverloadedError(TgisError):
    """More requests in flight than --max-concurrent-requests (HTTP 429)."""


class NodeError(TgisError):
    """A node of a multi-node server that never joined, does not match the others, or is gone."""


class GenerationError(TgisError):
    """The backend failed while generating (HTTP 424)."""
