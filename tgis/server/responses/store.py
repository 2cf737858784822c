"""The responses /v1/responses keeps, in memory, for `previous_response_id` and GET."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from starlette.requests import Request

from tgis.server.http.errors import ApiError


class ResponseStore:
    """The last `size` stored responses: their body and the conversation they end (the
    messages a response with `previous_response_id` continues). Least recently used out."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, tuple[dict[str, Any], tuple[dict[str, Any], ...]]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict[str, Any], conversation: tuple[dict[str, Any], ...]) -> None:
        if self.size == 0:
            return
        with self._lock:
            self._entries[body["id"]] = (body, conversation)
            self._entries.move_to_end(body["id"])
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def get(self, response_id: str, field_name: str) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """A stored response and its conversation; a 404 naming `field_name` when it is
        unknown or no longer kept."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
        if entry is None:
            raise ApiError(
                404,
                f"`{field_name}`: no response {response_id!r} is stored here (unknown, or "
                f"dropped: the server keeps the last {self.size}, --max-stored-responses)",
                "not_found",
            )
        return entry


def store_of(request: Request) -> ResponseStore:
    """The store of the app serving `request` (`create_app` puts it there)."""
    store: ResponseStore = request.app.state.tgis_responses
    return store
