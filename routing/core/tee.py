"""Read token counts out of an upstream response while the proxy streams it through.

The proxy hands every upstream chunk to `Tee.feed` and yields the same chunk to the client; the
tee only looks. At the end `Tee.usage()` says how many prompt, cached and completion tokens the
host reported, from the last `usage` object (OpenAI shape) or, failing that, llama-server's
`timings`; `Tee.prompt_ms()` how long the host took over the part of the prompt it evaluated
(`timings.prompt_ms`). Pure: no Django, no I/O, no event loop.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# A longer SSE line, or a larger JSON body, is not read for tokens: bounded memory per request.
MAX_BUFFER = 1024 * 1024

_USAGE_KEY = b'"usage"'
_TIMINGS_KEY = b'"timings"'


def _may_count(data: bytes) -> bool:
    """Whether `data` names `usage` or `timings`: only such lines are parsed.

    `bytes.find`, not `in`: `needle in data` first tries the needle as an integer (a byte
    value) and raises and clears a TypeError inside, which costs more than the search in an
    event of a few hundred bytes, and every chunk of a stream is looked at."""
    return data.find(_USAGE_KEY) >= 0 or data.find(_TIMINGS_KEY) >= 0


@dataclass(slots=True, frozen=True)
class Usage:
    """Token counts one response reported; None where the host did not say (never a made-up 0)."""

    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None


class Tee:
    """Watches one response's bytes for `usage` and `timings`.

    `content_type` picks the reader: `text/event-stream` (any case) reads SSE `data:` lines as
    they complete; otherwise a type containing "json" buffers the body (up to 1 MiB) and parses it
    in `usage()`; anything else counts nothing. `feed` never raises and never alters or keeps back
    the chunk; malformed input just yields unknown counts. Not thread-safe: one response, one
    caller.
    """

    __slots__ = (
        "streamed",
        "_json",
        "_pending",
        "_pending_len",
        "_skipping",
        "_usage",
        "_timings",
        "_body",
        "_result",
    )

    def __init__(self, content_type: str) -> None:
        kind = content_type.strip().lower()
        self.streamed: bool = kind.startswith("text/event-stream")
        self._json = not self.streamed and "json" in kind
        # The incomplete last SSE line, as the chunks it arrived in (joined once it completes).
        self._pending: list[bytes] = []
        self._pending_len = 0
        # True while discarding the rest of an over-long SSE line, up to its newline.
        self._skipping = False
        self._usage: dict[str, Any] | None = None
        self._timings: dict[str, Any] | None = None
        self._body: bytearray | None = bytearray() if self._json else None
        self._result: Usage | None = None

    def feed(self, chunk: bytes) -> None:
        """Look at the next chunk of the response body."""
        if self.streamed:
            if not self._pending and not self._skipping and chunk.endswith(b"\n"):
                # Whole lines, as a host writes its events: nothing to copy or keep.
                self._read_lines(chunk)
            else:
                self._feed_sse(chunk)
        elif self._body is not None:
            self._result = None
            if len(self._body) + len(chunk) > MAX_BUFFER:
                self._body = None
            else:
                self._body += chunk

    def usage(self) -> Usage:
        """The counts seen so far; call after the last chunk. Cheap to call again."""
        if self._result is None:
            if self._body is not None:
                self._read_json_body(self._body)
            self._result = _count_tokens(self._usage, self._timings)
        return self._result

    def prompt_ms(self) -> float | None:
        """The milliseconds the host reported evaluating the prompt's uncached part
        (llama-server's `timings.prompt_ms`); None when it did not say. Call after the last
        chunk."""
        self.usage()  # a JSON body is read there
        value = (self._timings or {}).get("prompt_ms")
        # json reads NaN and Infinity too, which no duration is.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value) and value >= 0:
                return float(value)
        return None

    def _feed_sse(self, chunk: bytes) -> None:
        """A chunk that ends inside a line, or follows one that did."""
        end = chunk.rfind(b"\n")
        if end < 0:
            self._keep_incomplete(chunk)
            return
        complete = chunk[:end]
        if self._skipping:
            self._skipping = False
            first_nl = complete.find(b"\n")
            complete = b"" if first_nl < 0 else complete[first_nl + 1 :]
        elif self._pending:
            self._pending.append(complete)
            complete = b"".join(self._pending)
            self._pending.clear()
            self._pending_len = 0
        self._read_lines(complete)
        self._keep_incomplete(chunk[end + 1 :])

    def _read_lines(self, complete: bytes) -> None:
        """Read the lines of `complete` (whole SSE lines) that carry counts: most carry none
        (llama-server's last event alone does), and those are only scanned."""
        if _may_count(complete):
            self._result = None
            for line in complete.split(b"\n"):
                if _may_count(line):
                    self._read_sse_line(line)

    def _keep_incomplete(self, tail: bytes) -> None:
        if not tail or self._skipping:
            return
        self._pending_len += len(tail)
        if self._pending_len > MAX_BUFFER:
            self._pending.clear()
            self._pending_len = 0
            self._skipping = True
        else:
            self._pending.append(tail)

    def _read_sse_line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        if not line.startswith(b"data:"):
            return
        event = _parse(line[5:])
        if isinstance(event, dict):
            self._remember(event)

    def _read_json_body(self, body: bytearray) -> None:
        document = _parse(body)
        if isinstance(document, dict):
            self._remember(document)

    def _remember(self, document: dict[str, Any]) -> None:
        # OpenAI clients send "usage": null on every chunk but the last; null must not erase.
        # Anthropic's stream says its input in message_start's message and its output in
        # message_delta, and the Responses API in response.completed's response: merged.
        usage = document.get("usage")
        for inner in ("message", "response"):
            nested = document.get(inner)
            if isinstance(nested, dict) and isinstance(nested.get("usage"), dict):
                usage = nested["usage"]
        if isinstance(usage, dict):
            self._usage = {**self._usage, **usage} if self._usage else usage
        timings = document.get("timings")
        if isinstance(timings, dict):
            self._timings = timings


def _parse(data: bytes | bytearray) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _count_tokens(usage: dict[str, Any] | None, timings: dict[str, Any] | None) -> Usage:
    usage = usage or {}
    timings = timings or {}
    details = usage.get("prompt_tokens_details")
    cache_n = _count(timings.get("cache_n"))

    prompt = _count(usage.get("prompt_tokens"))
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    if prompt is None and "input_tokens" in usage:
        prompt, cached = _input_tokens(usage)
    if prompt is None:
        # prompt_n counts only the tokens the host evaluated; the cached prefix is in cache_n.
        prompt_n = _count(timings.get("prompt_n"))
        if prompt_n is not None and cache_n is not None:
            prompt = prompt_n + cache_n

    if cached is None:
        cached = cache_n

    completion = _count(usage.get("completion_tokens"))
    if completion is None:
        completion = _count(usage.get("output_tokens"))
    if completion is None:
        completion = _count(timings.get("predicted_n"))

    return Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)


def _input_tokens(usage: dict[str, Any]) -> tuple[int | None, int | None]:
    """Prompt and cached tokens of Anthropic's usage (`input_tokens` leaves out the cached
    `cache_read_input_tokens`) or the Responses API's (`input_tokens` is the whole prompt)."""
    given = _count(usage.get("input_tokens"))
    if "cache_read_input_tokens" in usage:
        cache_read = _count(usage.get("cache_read_input_tokens"))
        whole = given + cache_read if given is not None and cache_read is not None else given
        return whole, cache_read
    details = usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return given, cached
