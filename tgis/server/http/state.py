"""What every route needs, stored once on the app (`app.state.tgis`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from tgis.config import ServeConfig
from tgis.engine.types import EngineClient
from tgis.server.chat.prompt import ChatFormat
from tgis.server.http.contract import RequestContract
from tgis.server.http.generation import Pipeline
from tgis.server.http.info import ModelInfo
from tgis.server.http.lifecycle import Lifecycle
from tgis.server.http.metrics import Metrics


@dataclass(frozen=True)
class ServerState:
    """The served model and the shared machinery of the routes."""

    engine: EngineClient
    tokenizer: Any
    config: ServeConfig
    info: ModelInfo
    metrics: Metrics
    pipeline: Pipeline
    lifecycle: Lifecycle
    # The API's request schemas (the ones /openapi.json publishes), compiled.
    contract: RequestContract
    # What the tokenizer says about chat: reasoning markers, the tool-call format.
    chat: ChatFormat


def get_state(request: Request) -> ServerState:
    """The ServerState of the app serving `request`."""
    state: ServerState = request.app.state.tgis
    return state
