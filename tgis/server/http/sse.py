"""Server-sent events, and noticing clients that go away.

Both helpers watch the ASGI `receive` channel for `http.disconnect` and cancel the work when
it comes. The work's `finally` blocks then close the engine iterator, so the engine drops the
request at its next step instead of generating for nobody.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tgis.server.http.errors import ApiError, Shape, classify, error_response

if TYPE_CHECKING:
    from tgis.server.http.metrics import Metrics

logger = logging.getLogger("tgis.server")

T = TypeVar("T")
Emit = Callable[[str], Awaitable[None]]
Producer = Callable[[Emit], Awaitable[None]]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@asynccontextmanager
async def stream_failures(
    metrics: Metrics, report: Callable[[ApiError], Awaitable[None]], events: Any
) -> AsyncIterator[None]:
    """The body of a started stream: a client that went away counts as `cancelled` (and the
    cancellation goes on); any other failure is classified, counted and sent by `report`, as
    the status line is gone, and ends the stream. The engine's `events` are closed either way."""
    try:
        yield
    except anyio.get_cancelled_exc_class():
        metrics.request_failed("cancelled")
        raise
    except Exception as exc:
        error = classify(exc)
        metrics.request_failed(error.error_type)
        await report(error)
    finally:
        await events.aclose()


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def failed_response(metrics: Metrics, exc: Exception, shape: Shape = "tgi") -> Response:
    """The response to a request that failed before its answer (`stream_failures` is a
    started stream's): 499 for a client that went away, counted as `cancelled`; else the
    error classified, counted and in the route family's shape."""
    if isinstance(exc, ClientDisconnected):
        metrics.request_failed("cancelled")
        return Response(status_code=499)
    error = classify(exc)
    metrics.request_failed(error.error_type)
    return error_response(error, shape)


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body has been read already, so the only message still to come is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()`, cancelling it if the client disconnects first (ClientDisconnected)."""
    outcome: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await _wait_for_disconnect(receive)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            outcome.append(await work())
        except Exception as exc:
            # Raised outside the task group, so callers see it as is (not an ExceptionGroup).
            failure.append(exc)
        group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not outcome:
        raise ClientDisconnected
    return outcome[0]


class EventStreamResponse(Response):
    """A `text/event-stream` response whose body a producer writes through `emit(text)`.

    Unlike Starlette's StreamingResponse it always watches for the disconnect (whatever the
    ASGI spec version) and the producer runs as plain code, not as an async generator that
    could be left suspended: when the client goes away the producer is cancelled where it
    waits, and its `finally` runs at once.
    """

    media_type = "text/event-stream"

    def __init__(self, producer: Producer, headers: dict[str, str] | None = None) -> None:
        self.producer = producer
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        disconnected = False

        async def emit(text: str) -> None:
            await send({"type": "http.response.body", "body": text.encode(), "more_body": True})

        async with anyio.create_task_group() as group:

            async def watch() -> None:
                nonlocal disconnected
                await _wait_for_disconnect(receive)
                disconnected = True
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self.producer(emit)
            except Exception:
                # Producers turn errors into error events; this is the last resort.
                logger.exception("an event stream failed")
            group.cancel_scope.cancel()
        if not disconnected:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
