"""Streaming clients for the APIs under test: TGI's `/generate_stream` and OpenAI's `/v1/...`
(and OpenAI's `/v1/embeddings`, one JSON answer per request: its latency is the measure).

Every request ends in a `RequestRecord`, never an exception: an HTTP error, a stall longer than
`stall_timeout`, a request longer than `request_timeout`, a stream that closes before its end
marker or an event that is not the JSON the API promises becomes the record's `error` kind:

    http_<status>  the server answered with that status
    timeout        no byte for `stall_timeout` seconds, or the request ran past `request_timeout`
    stream_closed  the connection or stream ended before the final event (TGI: the event with
                   `generated_text`; OpenAI: `[DONE]`, or a chunk with `finish_reason` followed
                   by the end of the stream, as the openai client accepts)
    connection     the server could not be reached
    malformed      an event that is not the API's JSON
    server_error   the server sent an error event inside the stream

    client = BenchmarkClient("http://127.0.0.1:3000", api="openai-chat", model="tgi")
    record = await client.send(turn, history=[])
    await client.aclose()

A turn's images (data URLs) go before its text: OpenAI chat's user message is a list of
`image_url` parts and then the text part; TGI's `inputs` starts with markdown images
(`![](data:...)`). OpenAI's completions API takes text only, so a turn with images cannot be
sent through it (ValueError). The prompt tokens of a request with images are the server's
count, image tokens included: OpenAI's `usage.prompt_tokens`, TGI's `details.input_length`
(such requests ask for `details`); a server that sends neither leaves the text's tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from tgis.benchmark.prompts import Turn

Api = Literal["tgi", "openai-chat", "openai-completions", "embeddings"]
APIS: tuple[str, ...] = ("tgi", "openai-chat", "openai-completions", "embeddings")
PATHS: dict[str, str] = {
    "tgi": "/generate_stream",
    "openai-chat": "/v1/chat/completions",
    "openai-completions": "/v1/completions",
    # OpenAI's embeddings (tgis, vLLM and TEI serve it): one JSON answer, no stream.
    "embeddings": "/v1/embeddings",
}


class MalformedEvent(Exception):
    """An event of the stream is not what the API promises."""


@dataclass
class RequestRecord:
    """What one request did. Times are `time.perf_counter()` seconds."""

    start: float
    prompt_tokens: int
    max_new_tokens: int
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str | None = None
    error_message: str = ""
    turn: int = 0  # index of the turn in its session (set by the load driver)
    warmup: bool = False  # started during its step's warmup (set by the load driver)
    usage_tokens: int | None = None  # completion tokens the server reported, if it did
    special_tokens: int = 0  # TGI: tokens marked special (counted, but without text)
    finish_reason: str | None = None  # OpenAI: the last `finish_reason` of the chunks

    @property
    def ok(self) -> bool:
        """True when the request finished without error."""
        return self.error is None

    @property
    def ttft(self) -> float | None:
        """Seconds from sending the request to its first token (None without tokens)."""
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def latency(self) -> float:
        """End-to-end seconds."""
        return self.end - self.start


def markdown_images(urls: Sequence[str]) -> str:
    """Images as TGI's `inputs` writes them: one markdown image `![](url)` per URL."""
    return "".join(f"![]({url})" for url in urls)


def prompt_text(turn: Turn, history: Sequence[tuple[Turn, RequestRecord]]) -> str:
    """The prompt of a plain-text API: earlier prompts and answers, then this turn's text,
    each turn's images as markdown images before its text.

    `history` pairs each earlier turn with the record of its answer.
    """
    earlier = "".join(markdown_images(t.images) + t.text + answer.text for t, answer in history)
    return earlier + markdown_images(turn.images) + turn.text


def user_message(turn: Turn) -> dict[str, Any]:
    """OpenAI chat's user message of `turn`: its text, or its images' `image_url` parts and
    then a text part."""
    if not turn.images:
        return {"role": "user", "content": turn.text}
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": url}} for url in turn.images
    ]
    return {"role": "user", "content": [*parts, {"type": "text", "text": turn.text}]}


class BenchmarkClient:
    """Sends turns to one server through one API and records each request's timings."""

    def __init__(
        self,
        base_url: str,
        api: Api = "tgi",
        model: str = "tgi",
        request_timeout: float = 120.0,
        stall_timeout: float = 30.0,
        extra_parameters: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        adapters: Sequence[str] = (),
    ) -> None:
        """`adapters`: LoRA adapters the requests go through in turn (TGI's adapter_id,
        OpenAI's model; "" is the base model); none: every request is the model's."""
        if api not in PATHS:
            raise ValueError(f"unknown api {api!r}: choose one of {', '.join(APIS)}")
        if request_timeout <= 0 or stall_timeout <= 0:
            raise ValueError("request_timeout and stall_timeout must be positive")
        self.api = api
        self.model = model
        self.request_timeout = request_timeout
        self.extra_parameters = dict(extra_parameters or {})
        self.adapters = tuple(adapters)
        self._sent = itertools.count()
        # trust_env=False: a proxy set in the environment must not sit between us and the server.
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=httpx.Timeout(stall_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            headers=headers,
            trust_env=False,
            transport=transport,
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    def body(self, turn: Turn, history: Sequence[tuple[Turn, RequestRecord]]) -> dict[str, Any]:
        """The JSON body of a streaming request for `turn` after `history`."""
        images = bool(turn.images) or any(t.images for t, _ in history)
        if images and self.api in ("openai-completions", "embeddings"):
            kind = "completions" if self.api == "openai-completions" else "embeddings"
            raise ValueError(
                f"OpenAI's {kind} API takes text only: send images through the chat API or TGI's"
            )
        adapter = self.adapters[next(self._sent) % len(self.adapters)] if self.adapters else ""
        if self.api == "embeddings":
            text = prompt_text(turn, history)
            return {"model": adapter or self.model, "input": text, **self.extra_parameters}
        if self.api == "tgi":
            parameters = {"max_new_tokens": turn.max_new_tokens, **self.extra_parameters}
            if adapter:
                parameters["adapter_id"] = adapter
            if images:
                # The final event's details then hold the prompt's length, image tokens included.
                parameters["details"] = True
            return {"inputs": prompt_text(turn, history), "parameters": parameters}
        body: dict[str, Any] = {
            "model": adapter or self.model,
            "max_tokens": turn.max_new_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_parameters,
        }
        if self.api == "openai-completions":
            body["prompt"] = prompt_text(turn, history)
            return body
        messages: list[dict[str, Any]] = []
        for t, answer in history:
            messages.append(user_message(t))
            messages.append({"role": "assistant", "content": answer.text})
        body["messages"] = [*messages, user_message(turn)]
        return body

    async def send(
        self, turn: Turn, history: Sequence[tuple[Turn, RequestRecord]] = ()
    ) -> RequestRecord:
        """Stream one request; always returns its record (see the module doc for errors)."""
        prompt_tokens = turn.tokens + sum(t.tokens + r.output_tokens for t, r in history)
        record = RequestRecord(time.perf_counter(), prompt_tokens, turn.max_new_tokens)
        try:
            await asyncio.wait_for(self._stream(turn, history, record), self.request_timeout)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            record.error = "timeout"
        except httpx.ConnectError as exc:
            record.error, record.error_message = "connection", str(exc)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.StreamClosed) as exc:
            record.error, record.error_message = "stream_closed", str(exc)
        except httpx.TransportError as exc:
            record.error, record.error_message = "connection", str(exc)
        except MalformedEvent as exc:
            record.error, record.error_message = "malformed", str(exc)
        if record.ok and record.usage_tokens is not None:
            record.output_tokens = record.usage_tokens
        record.end = time.perf_counter()
        return record

    async def _stream(
        self, turn: Turn, history: Sequence[tuple[Turn, RequestRecord]], record: RequestRecord
    ) -> None:
        body = self.body(turn, history)
        if self.api == "embeddings":
            await self._embed(body, record)
            return
        async with self._http.stream("POST", PATHS[self.api], json=body) as response:
            if response.status_code != 200:
                message = (await response.aread()).decode(errors="replace")[:500]
                record.error, record.error_message = f"http_{response.status_code}", message
                return
            finished = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                try:
                    if self.api == "tgi":
                        finished = self._tgi_event(_json(data), record)
                    elif data == "[DONE]":
                        finished = True
                    else:
                        self._openai_event(_json(data), record)
                except (AttributeError, TypeError, ValueError) as exc:
                    # Fields of the wrong type (a string for an object, a word for a count).
                    raise MalformedEvent(f"{exc}: {data[:200]!r}") from exc
                if finished or record.error:
                    return
            if self.api != "tgi" and record.finish_reason is not None:
                # The server closed the stream after the chunk with the finish reason but sent
                # no `[DONE]` (transformers serve 5.x): complete, as the openai client reads it.
                return
            record.error = "stream_closed"
            record.error_message = "the stream ended before its final event"

    async def _embed(self, body: dict[str, Any], record: RequestRecord) -> None:
        """One embeddings request: its answer is the whole record (no tokens come back; the
        answer's arrival is its one event, and its usage the prompt's tokens)."""
        response = await self._http.post(PATHS["embeddings"], json=body)
        if response.status_code != 200:
            record.error = f"http_{response.status_code}"
            record.error_message = response.text[:500]
            return
        try:
            answer = response.json()
            vectors = [item["embedding"] for item in answer["data"]]
            usage = answer.get("usage") or {}
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedEvent(f"{exc}: {response.text[:200]!r}") from exc
        if not vectors or not all(isinstance(v, list | str) and v for v in vectors):
            raise MalformedEvent(f"no embedding in {response.text[:200]!r}")
        record.token_times.append(time.perf_counter())
        record.finish_reason = "stop"
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]

    def _tgi_event(self, event: Any, record: RequestRecord) -> bool:
        """Record a TGI stream event; True on the final one."""
        if not isinstance(event, dict):
            raise MalformedEvent(f"expected a JSON object, got {event!r}"[:200])
        if "error" in event:
            record.error, record.error_message = "server_error", str(event["error"])
            return False
        token = event.get("token")
        if not isinstance(token, dict):
            raise MalformedEvent(f"a TGI event without `token`: {event!r}"[:200])
        record.token_times.append(time.perf_counter())
        record.output_tokens += 1
        if token.get("special"):
            record.special_tokens += 1
        else:
            record.text += str(token.get("text", ""))
        details = event.get("details")
        if isinstance(details, dict) and details.get("input_length") is not None:
            # The server's count of the prompt (sent when asked for details) beats ours.
            record.prompt_tokens = int(details["input_length"])
        return event.get("generated_text") is not None

    def _openai_event(self, event: Any, record: RequestRecord) -> None:
        """Record an OpenAI chunk (content, usage or error)."""
        if not isinstance(event, dict):
            raise MalformedEvent(f"expected a JSON object, got {event!r}"[:200])
        if "error" in event:
            record.error, record.error_message = "server_error", str(event["error"])[:500]
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            # The server's own count beats ours (a chunk may carry several tokens).
            record.usage_tokens = int(usage["completion_tokens"])
            record.prompt_tokens = int(usage.get("prompt_tokens", record.prompt_tokens))
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise MalformedEvent(f"an OpenAI chunk without `choices`: {event!r}"[:200])
        for choice in choices:
            if not isinstance(choice, dict):
                raise MalformedEvent(f"a choice that is not an object: {choice!r}"[:200])
            if self.api == "openai-completions":
                text = choice.get("text")
            else:
                text = (choice.get("delta") or {}).get("content")
            if text is not None and not isinstance(text, str):
                raise MalformedEvent(f"a choice whose text is not a string: {choice!r}"[:200])
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                record.finish_reason = reason
            if text:
                record.token_times.append(time.perf_counter())
                record.output_tokens += 1
                record.text += text


def _json(data: str) -> Any:
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise MalformedEvent(f"an event that is not JSON: {data[:200]!r}") from exc
