"""How long a request's head may take to arrive: `CROSSBAR_HEAD_TIMEOUT` seconds, on both servers.

A client that opens connections and trickles header bytes (a header line every few seconds,
each one progress, so no idle timeout fires) would otherwise hold each connection, and the
server's memory for it, for as long as it likes: neither daphne nor uvicorn limits the time
a head takes. Here it is limited, and what the limit covers is the head alone:

- it runs from the connection's opening for its first request, and from the first byte of
  each later request on a kept-alive connection, until the blank line that ends the head;
- a body (a slow upload, however long), the application's answer (a stream that takes
  minutes) and a kept-alive connection idle between two requests are not the head's: the
  body is bounded by `DATA_UPLOAD_MAX_MEMORY_SIZE`, a stream by `CROSSBAR_STREAM_IDLE_TIMEOUT`,
  an idle connection by each server's own keep-alive rules.

A head that does not arrive in time is answered `408 Request Timeout` and the connection is
closed; `crossbar_head_timeouts_total` counts them (a steady count is a client, or an attack,
opening connections it does not use). crossbar_site/daphne_server.py and
crossbar_site/uvicorn_server.py each keep the clock in their own protocol.
"""

from __future__ import annotations

from django.conf import settings

from routing.ops.metrics import HEAD_TIMEOUTS

_SAID = b"request head not received in time\n"
ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_SAID), _SAID)
)


def head_timeout() -> float:
    """Seconds a request's head may take (`CROSSBAR_HEAD_TIMEOUT`)."""
    return float(settings.CROSSBAR["HEAD_TIMEOUT"])


def late() -> bytes:
    """Count a head that did not arrive in time; the bytes to answer it with, before closing."""
    HEAD_TIMEOUTS.inc()
    return ANSWER
