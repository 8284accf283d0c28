"""This machine as the tests use it: the checkout's root, a free local port."""

from __future__ import annotations

import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
