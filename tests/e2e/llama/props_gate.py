"""A relay in front of a real llama-server that can hold its `/props` answers, as the fake's
`props_open` does: a gateway that reads the host through it has not read its slots while a
`/props` is held, however long the test needs.

Each request goes upstream on a connection of its own (`Connection: close`), so that every
request's head is seen here; bytes pass through otherwise untouched, streams included.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class PropsGate:
    """The relay's address (`url`), `props_open` (set at first: while it is clear, a GET
    /props waits until it is set again) and `props_asked` (how many GET /props came)."""

    url: str = ""
    props_open: threading.Event = field(default_factory=threading.Event)
    props_asked: int = 0


def _closing(head: bytes) -> bytes:
    """The request head with `Connection: close` in place of any Connection header."""
    lines = [line for line in head.split(b"\r\n") if line]
    kept = [line for line in lines[1:] if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n"


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()


async def _serve(gate: PropsGate, port: int, ready: threading.Event, stop: asyncio.Event) -> None:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /props"):
                gate.props_asked += 1
                await asyncio.to_thread(gate.props_open.wait)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
            up_writer.write(_closing(head))
            upstream = asyncio.ensure_future(_pipe(reader, up_writer))
            await _pipe(up_reader, writer)  # the answer, until llama-server closes
            upstream.cancel()
            up_writer.close()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    gate.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    ready.set()
    async with server:
        await stop.wait()


@contextlib.contextmanager
def props_gate(port: int) -> Iterator[PropsGate]:
    """A relay to the llama-server on 127.0.0.1:`port`, running until the block ends."""
    gate = PropsGate()
    gate.props_open.set()
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(_serve(gate, port, ready, stop),), daemon=True
    )
    thread.start()
    ready.wait(10)
    try:
        yield gate
    finally:
        gate.props_open.set()  # a /props held open would keep its thread waiting
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
