"""The socket `manage.py crossbar_serve` listens on (crossbar_site/serve.py), as every
connection it accepts inherits it, on daphne and on uvicorn alike."""

from __future__ import annotations

import socket

from crossbar_site.serve import listen


def test_a_connection_the_gateway_accepts_sends_small_writes_at_once() -> None:
    # TCP_NODELAY: a stream's first token, a small write right after its head's, goes out at
    # once instead of waiting for the client's delayed ACK of the head (Nagle's algorithm),
    # which daphne's Twisted never turns off itself (bench/README.md, "Where the first token
    # waits"). The option, not a delay, is asserted: a delay is the machine's as much as ours.
    with listen("127.0.0.1", 0) as listening:
        listening.setblocking(True)
        with socket.create_connection(listening.getsockname()[:2], timeout=5):
            accepted, _ = listening.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
