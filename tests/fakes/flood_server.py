"""A host that answers every completion with one huge SSE stream, as fast as TCP takes it.

For backpressure tests: `sent` counts the bytes the socket accepted so far, so a test can see
whether the gateway kept reading from the host while its own client read nothing. Health and
model-list polls are answered like llama-server's, so the gateway treats it as a healthy host.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import TracebackType

_DELTA = {"choices": [{"delta": {"content": "x" * 65000}}]}
EVENT = b"data: " + json.dumps(_DELTA).encode() + b"\n\n"
DONE = b"data: [DONE]\n\n"


class FloodServer:
    """Streams `total` bytes of SSE events (then `data: [DONE]`) to each completion request."""

    def __init__(self, total: int, model: str = "test-model") -> None:
        self.total = total - total % len(EVENT)  # whole events
        self.model = model
        self.sent = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stream_bytes(self) -> int:
        """The length of one whole answer body."""
        return self.total + len(DONE)

    def __enter__(self) -> FloodServer:
        ready = threading.Event()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            server = loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            server.close()
            loop.run_until_complete(server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name="flood-server", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ", 2)[1].decode()
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    await reader.readexactly(int(line.split(b":")[1]))
            if target == "/v1/chat/completions":
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Connection: close\r\n\r\n"
                )
                while self.sent < self.total:
                    writer.write(EVENT)
                    await writer.drain()
                    self.sent += len(EVENT)
                writer.write(DONE)
            else:
                document: dict[str, object] = (
                    {"status": "ok"}
                    if target == "/health"
                    else {"object": "list", "data": [{"id": self.model, "object": "model"}]}
                )
                body = json.dumps(document).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body)
                )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
