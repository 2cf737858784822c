"""Graceful shutdown: stop admitting, let in-flight requests finish, then cancel the rest.

On SIGTERM (or SIGINT) `serve` keeps the listening socket open while it drains, so load
balancers and clients get a clear 503 `{"error": "Server is shutting down", "error_type":
"unavailable"}` for new generation requests (and from `/health`) instead of connection
errors. After `shutdown_grace_s` the requests still running are cancelled: their engine
iterators close (freeing their sequences), a stream gets a final error event, a request that
has not answered yet gets the 503. A second SIGINT skips the wait.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Generator, Sequence
from ssl import CERT_REQUIRED
from types import FrameType
from typing import Any, Protocol

import anyio
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tgis.config.types import TlsFiles
from tgis.server.http.errors import SHUTTING_DOWN, error_body, error_event, error_status, shape_of
from tgis.server.http.timeouts import timed_h11_protocol

logger = logging.getLogger("tgis.server")

# The routes that start work; everything else (health, info, metrics, docs) stays open.
GATED_PATHS = frozenset(
    {
        "/",
        "/generate",
        "/generate_stream",
        "/tokenize",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)


class Lifecycle:
    """Admission control of one app: whether it admits requests, and those in flight."""

    def __init__(self) -> None:
        self.draining = False
        self._active: set[anyio.CancelScope] = set()

    @property
    def in_flight(self) -> int:
        """Generation requests admitted and not finished (streams included)."""
        return len(self._active)

    def begin_drain(self) -> None:
        """Stop admitting generation requests (safe to call from a signal handler)."""
        self.draining = True

    async def drain(self, grace_s: float, abort: Callable[[], bool] = lambda: False) -> int:
        """Stop admitting, wait up to `grace_s` for in-flight requests, cancel the rest.

        `abort()` true ends the wait early. Returns how many requests were cancelled.
        """
        self.begin_drain()
        if self._active:
            logger.info(
                "draining %d in-flight request(s), up to %.1f s", len(self._active), grace_s
            )
        with anyio.move_on_after(grace_s):
            while self._active and not abort():
                await anyio.sleep(0.05)
        cancelled = len(self._active)
        if cancelled:
            logger.warning(
                "cancelling %d request(s) still running after the grace period", cancelled
            )
        for scope in list(self._active):
            scope.cancel()
        # Let the cancelled requests send their last bytes before the server closes sockets.
        with anyio.move_on_after(2.0):
            while self._active:
                await anyio.sleep(0.01)
        return cancelled


class LifecycleMiddleware:
    """ASGI middleware: 503 while draining; each admitted request is cancellable by `drain`."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GATED_PATHS:
            await self.app(scope, receive, send)
            return
        shape = shape_of(scope["path"])
        if self.lifecycle.draining:
            await _send_json(
                send, error_status(SHUTTING_DOWN, shape), error_body(SHUTTING_DOWN, shape)
            )
            return
        started = finished = event_stream = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, finished, event_stream
            if message["type"] == "http.response.start":
                started = True
                headers = dict(message.get("headers", []))
                event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        with anyio.CancelScope() as cancel_scope:
            self.lifecycle._active.add(cancel_scope)
            try:
                await self.app(scope, receive, tracking_send)
            finally:
                self.lifecycle._active.discard(cancel_scope)
        if not cancel_scope.cancelled_caught or finished:
            return
        if not started:
            await _send_json(
                send, error_status(SHUTTING_DOWN, shape), error_body(SHUTTING_DOWN, shape)
            )
        elif event_stream:
            event = error_event(SHUTTING_DOWN, shape)
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class Companion(Protocol):
    """Another server in the same event loop (the gRPC API), started before HTTP serves and
    stopped while HTTP drains."""

    async def start(self) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the app's Lifecycle before it closes the listening socket
    (and stops its companions in the same grace period)."""

    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: Lifecycle,
        shutdown_grace_s: float,
        companions: Sequence[Companion] = (),
    ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.shutdown_grace_s = shutdown_grace_s
        self.companions = list(companions)

    def request_shutdown(self) -> None:
        """Start a graceful shutdown, as SIGTERM does (callable from any thread)."""
        self.lifecycle.begin_drain()
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: set flags only; main_loop notices them within 0.1 s.
        if self.should_exit:
            self.force_exit = True
        self.request_shutdown()

    async def main_loop(self) -> None:
        await super().main_loop()
        grace = 0.0 if self.force_exit else self.shutdown_grace_s
        async with anyio.create_task_group() as group:
            for companion in self.companions:
                group.start_soon(companion.stop, grace)
            if not self.force_exit:
                await self.lifecycle.drain(grace, abort=lambda: self.force_exit)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the signal after shutting down (exit status 143); a drained
        # server has shut down cleanly, so it restores the handlers and returns instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class ServerThread:
    """The HTTP and gRPC servers on an event loop in a thread of their own, so that the
    process's main thread can run the model (the engine's loop). Python delivers SIGTERM and
    SIGINT to the main thread: `start` installs handlers there that hand them to the server,
    which then drains as it would on the main thread.

    `main(server_ready)` is the coroutine that serves (it passes `server_ready` to `serve`);
    `on_exit` runs on the server's thread once it has stopped, however it stopped (`tgis
    serve` stops the engine's loop there)."""

    def __init__(
        self,
        main: Callable[[Callable[[GracefulServer], None]], Awaitable[None]],
        on_exit: Callable[[], None],
    ) -> None:
        self._main = main
        self._on_exit = on_exit
        # Re-entrant: a second signal may arrive while the handler of the first holds it.
        self._lock = threading.RLock()
        self._server: GracefulServer | None = None
        self._signals: list[int] = []  # received before the server existed
        self._original: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._run, name="tgis-http", daemon=True)
        # Why the servers ended other than by a signal: an exception, or SystemExit (uvicorn
        # exits 1 when it cannot listen); None after a clean shutdown.
        self.failure: BaseException | None = None

    def start(self) -> None:
        """Install the signal handlers (on the main thread) and start serving."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._original[sig] = signal.signal(sig, self._on_signal)
        self._thread.start()

    def join(self) -> None:
        """Wait for the servers to stop, then restore the signal handlers."""
        while self._thread.is_alive():
            self._thread.join(0.5)  # short waits: signal handlers run in between
        for sig, handler in self._original.items():
            signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        with self._lock:
            server = self._server
            if server is None:
                self._signals.append(sig)
        if server is not None:
            server.handle_exit(sig, frame)

    def _ready(self, server: GracefulServer) -> None:
        with self._lock:
            self._server = server
            pending, self._signals = self._signals, []
        for sig in pending:
            server.handle_exit(sig, None)

    def _run(self) -> None:
        import asyncio

        try:
            asyncio.run(self._main(self._ready))  # type: ignore[arg-type]
        except SystemExit as exc:
            if exc.code not in (None, 0):
                self.failure = exc
        except BaseException as exc:
            logger.exception("the HTTP server failed")
            self.failure = exc
        finally:
            self._on_exit()


def lifecycle_of(app: Any) -> Lifecycle:
    """The Lifecycle `create_app` attached to `app` (a fresh one for other apps)."""
    state = getattr(getattr(app, "state", None), "tgis", None)
    return state.lifecycle if state is not None else Lifecycle()


async def serve(
    app: ASGIApp,
    host: str,
    port: int,
    shutdown_grace_s: float = 30.0,
    *,
    log_level: str = "info",
    server_ready: Callable[[GracefulServer], None] | None = None,
    tls: TlsFiles | None = None,
    companions: Sequence[Companion] = (),
    header_timeout_s: float = 10.0,
    body_timeout_s: float = 60.0,
    keep_alive_timeout_s: float = 5.0,
) -> None:
    """Serve `app` with uvicorn until SIGTERM/SIGINT, then shut down gracefully.

    `tls`: HTTPS, and with a client CA, mutual TLS (clients without a certificate it signed
    are refused at the handshake). `companions` start before HTTP listens and stop while it
    drains. `server_ready(server)` is called with the server before it starts (tests use it
    to call `server.request_shutdown()` from another thread). A client gets
    `header_timeout_s` to send a request's headers and `body_timeout_s` more for its body
    (tgis.server.http.timeouts); an idle keep-alive connection is closed after
    `keep_alive_timeout_s`.
    """
    ssl: dict[str, Any] = {}
    if tls is not None:
        ssl = {"ssl_certfile": tls.cert_path, "ssl_keyfile": tls.key_path}
        if tls.client_ca_cert_path:
            ssl.update(ssl_ca_certs=tls.client_ca_cert_path, ssl_cert_reqs=CERT_REQUIRED)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=timed_h11_protocol(header_timeout_s, body_timeout_s),
        # uvicorn takes any number of seconds here (it hands them to loop.call_later).
        timeout_keep_alive=keep_alive_timeout_s,  # type: ignore[arg-type]
        # The drain already waited for requests; this only bounds closing idle connections.
        timeout_graceful_shutdown=5,
        **ssl,
    )
    server = GracefulServer(config, lifecycle_of(app), shutdown_grace_s, companions)
    if server_ready is not None:
        server_ready(server)
    started: list[Companion] = []
    try:
        for companion in companions:
            await companion.start()
            started.append(companion)
        await server.serve()
    finally:
        if not server.started:  # HTTP never served: nothing stopped the companions
            for companion in started:
                await companion.stop(0)
