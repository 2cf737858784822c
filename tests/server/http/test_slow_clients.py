"""Slow clients cannot hold connections: a request's headers and body have deadlines, and an
idle keep-alive connection is closed (tgis.server.http.timeouts, through tgis.server.serve)."""

from __future__ import annotations

import http.client
import select
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from starlette.applications import Starlette

from tests.server.conftest import live_server
from tests.server.fakes import FakeEngine

HEADER_S = 0.5
BODY_S = 0.5
KEEP_ALIVE_S = 1.0
TICK_S = 0.2
# Each deadline is checked from below only (a timer cannot fire early; 0.05 s for the clock's
# grain): how late it fires depends on how busy the machine is. That the right one fired is
# in what the server sends (a 408 naming the deadline, or nothing) and in deadlines set far
# apart where two could close the same connection.
EARLY_S = 0.05

pytestmark = pytest.mark.timeout(30)


@contextmanager
def timed_server(
    app: Starlette,
    header_timeout_s: float = HEADER_S,
    body_timeout_s: float = BODY_S,
    keep_alive_timeout_s: float = KEEP_ALIVE_S,
) -> Iterator[int]:
    """Serve `app` on 127.0.0.1 (a free port) in a thread with these deadlines; its port."""
    with live_server(
        app,
        1.0,
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        keep_alive_timeout_s=keep_alive_timeout_s,
    ) as (_, server):
        yield server.servers[0].sockets[0].getsockname()[1]


@pytest.fixture
def port(app: Starlette) -> Iterator[int]:
    with timed_server(app) as bound:
        yield bound


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def get(path: str = "/health") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response from `sock` (status, body); the socket stays usable for the next."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.read()


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def trickle(sock: socket.socket, byte: bytes = b"a") -> tuple[bytes, float]:
    """Send `byte` every TICK_S until the server answers or closes; (what it sent, when)."""
    for _ in range(int(10 / TICK_S)):
        readable, _, _ = select.select([sock], [], [], TICK_S)
        if readable:
            return read_until_closed(sock), time.monotonic()
        sock.sendall(byte)
    raise AssertionError("the server kept the trickling connection open for 10 s")


def test_trickled_headers_are_cut_off_with_408(port: int, engine: FakeEngine) -> None:
    with connect(port) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        answer, closed = trickle(sock)
    assert closed - start >= HEADER_S - EARLY_S
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b"connection: close" in answer.lower()
    assert answer.endswith(b"The request headers did not arrive within 0.5 s.")


def test_silent_connection_is_closed_without_an_answer(app: Starlette) -> None:
    """The header deadline, not the keep-alive timeout (set 60 times longer here, beyond the
    socket's own 5 s), closes a connection that sends nothing."""
    with timed_server(app, keep_alive_timeout_s=HEADER_S * 60) as port, connect(port) as sock:
        start = time.monotonic()
        assert read_until_closed(sock) == b""
    assert time.monotonic() - start >= HEADER_S - EARLY_S


def test_trickled_body_is_cut_off_with_408(port: int, engine: FakeEngine) -> None:
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    with connect(port) as sock:
        sock.sendall(head)
        start = time.monotonic()
        answer, closed = trickle(sock, b" ")
    assert closed - start >= BODY_S - EARLY_S
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert answer.endswith(b"The request body did not arrive within 0.5 s.")
    assert engine.requests == []  # the route never got a body to generate from


def test_requests_in_time_are_served(port: int) -> None:
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/health").status_code == 200
    response = httpx.post(f"{base}/generate", json={"inputs": "Hello"})
    assert response.status_code == 200 and response.json()["generated_text"]
    first, second = b'{"inputs": ', b'"Hi"}'
    length = len(first + second)
    with connect(port) as sock:
        # Headers in two parts, and a body in two parts, each well within its deadline.
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        time.sleep(HEADER_S / 3)
        sock.sendall(f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode())
        time.sleep(BODY_S / 3)
        sock.sendall(first)
        time.sleep(BODY_S / 3)
        sock.sendall(second)
        status, body = read_response(sock)
    assert status == 200 and b"generated_text" in body


def test_each_request_on_a_keep_alive_connection_gets_its_own_header_deadline(
    port: int,
) -> None:
    """Four requests over one connection take longer than one header deadline in all."""
    with connect(port) as sock:
        start = time.monotonic()
        for _ in range(4):
            sock.sendall(get())
            assert read_response(sock)[0] == 200
            time.sleep(HEADER_S * 0.6)
        assert time.monotonic() - start > 2 * HEADER_S
        sock.sendall(get("/info"))
        assert read_response(sock)[0] == 200


def test_idle_keep_alive_connection_is_closed_after_its_timeout(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(get())
        assert read_response(sock)[0] == 200
        answered = time.monotonic()
        assert read_until_closed(sock) == b""  # closed without a word
    # The keep-alive timeout (1 s), not the header deadline (0.5 s), governs an idle wait.
    assert time.monotonic() - answered >= KEEP_ALIVE_S - EARLY_S


def test_idle_wait_shorter_than_keep_alive_is_not_cut_by_the_header_deadline(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(get())
        assert read_response(sock)[0] == 200
        time.sleep(HEADER_S + 0.2)  # longer than the header deadline, within keep-alive
        sock.sendall(get())
        assert read_response(sock)[0] == 200


def test_body_finished_after_its_answer_leaves_a_keep_alive_wait(port: int) -> None:
    """GET /health answers without reading the body; once the body has come in, the idle
    connection is closed after the keep-alive timeout, as after any answer."""
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        assert read_response(sock)[0] == 200
        time.sleep(BODY_S / 3)
        sock.sendall(b"abcde")
        done = time.monotonic()
        assert read_until_closed(sock) == b""
    assert time.monotonic() - done >= KEEP_ALIVE_S - EARLY_S


def test_next_request_trickled_on_a_keep_alive_connection_is_cut_off(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(get())
        assert read_response(sock)[0] == 200
        time.sleep(HEADER_S * 0.6)  # idle (keep-alive's wait), then a slow request begins
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        answer, closed = trickle(sock, b"X")
    # The deadline runs from the request's first byte, not from the previous answer.
    assert closed - start >= HEADER_S - EARLY_S
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer


def test_pipelined_partial_request_gets_a_deadline_after_the_answer_before_it(
    port: int,
) -> None:
    """A complete request and the start of the next in one packet: the next one's headers
    are due within the deadline once the first is answered."""
    with connect(port) as sock:
        sock.sendall(get() + b"GET /health HTTP/1.1\r\nX-Slow: ")
        status, _ = read_response(sock)
        assert status == 200
        answer, _ = trickle(sock)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer


def test_serve_passes_the_deadlines_to_uvicorn(
    app: Starlette, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tgis.server.serve builds uvicorn's config with the timed h11 protocol."""
    import uvicorn

    from tgis.server.http.timeouts import TimedH11Protocol

    configs: list[uvicorn.Config] = []
    original: Callable[..., None] = uvicorn.Config.__init__

    def record(self: uvicorn.Config, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        configs.append(self)

    monkeypatch.setattr(uvicorn.Config, "__init__", record)
    with timed_server(app, header_timeout_s=3.0, body_timeout_s=7.0, keep_alive_timeout_s=2.0):
        pass
    (config,) = configs
    assert isinstance(config.http, type) and issubclass(config.http, TimedH11Protocol)
    assert (config.http.header_timeout_s, config.http.body_timeout_s) == (3.0, 7.0)
    assert config.timeout_keep_alive == 2.0
    assert TimedH11Protocol.header_timeout_s == 10.0  # the base class keeps its defaults
