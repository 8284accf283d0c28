"""Serving crossbar: `manage.py crossbar_serve`, what `make run` runs, on daphne or uvicorn.

`CROSSBAR_SERVER` picks the server: `daphne` (the default, crossbar_site/daphne_server.py) or
`uvicorn` (crossbar_site/uvicorn_server.py, less CPU per streamed chunk). Either serves the
same ASGI application (crossbar_site/asgi.py), with the same guards on both:

- a request's head has `CROSSBAR_HEAD_TIMEOUT` seconds to arrive whole, else 408 and the
  connection closed (crossbar_site/heads.py; each server's protocol keeps the clock);
- a request body is read only up to the cap, then answered 413 (crossbar_site/handler.py);
- a slow reader never holds a host's slot at its own pace, and one that reads nothing for
  `CROSSBAR_STREAM_IDLE_TIMEOUT` is cut (routing/proxy/relay.py);
- SIGTERM or SIGINT drains and stops: `/health` answers `draining` while the requests in flight
  finish, for up to `CROSSBAR_SHUTDOWN_GRACE` seconds, then the listener closes, and the process
  exits 0, or 75 when accounting rows were left in the spool (crossbar_site/lifecycle.py).

This module binds the listening socket (a backlog of 1024, where Twisted's default is 50) and
hands it to the server. With `CROSSBAR_WORKERS=N` it supervises N worker processes instead, each
binding its own socket on the same port with SO_REUSEPORT (crossbar_site/workers.py).
"""

from __future__ import annotations

import gc
import logging
import os
import socket

from django.conf import settings
from django.core.management.base import CommandError

log = logging.getLogger("crossbar.serve")

SERVERS = ("daphne", "uvicorn")
BACKLOG = 1024


def server_named(name: str | None) -> str:
    """The server to serve with: `name`, else `CROSSBAR_SERVER`, else daphne.

    Raises CommandError, one line saying why, for another name."""
    server = (name or os.environ.get("CROSSBAR_SERVER") or "daphne").strip()
    if server not in SERVERS:
        raise CommandError(f"CROSSBAR_SERVER is daphne or uvicorn, not {server!r}")
    return server


def check(server: str | None) -> tuple[str, int]:
    """The server and the number of worker processes the settings ask for.

    Raises CommandError, one line saying why, for a bad server, number of workers (or workers
    without Redis), or Redis URL: everything that would stop `serve` before it listens."""
    from crossbar_site import workers
    from routing.shared.state import url_problem

    if settings.REDIS_URL and (problem := url_problem(settings.REDIS_URL)):
        raise CommandError(problem)
    return server_named(server), workers.count()


def serve(host: str, port: int, *, grace: float, server: str | None = None) -> None:
    """Serve the site on host:port until SIGTERM/SIGINT, then stop gracefully. Blocks.

    Raises CommandError as `check` does, or when host:port cannot be listened on."""
    from crossbar_site import workers

    server, wanted = check(server)
    lifeline = workers.lifeline()
    if lifeline is None and wanted > 1:
        code = workers.supervise(host, port, wanted, grace=grace, server=server)
        if code:
            raise SystemExit(code)
        return
    listening = listen(host, port, reuse_port=lifeline is not None)
    address, bound = listening.getsockname()[:2]
    log.info("listening on http://%s:%s (%s)", address, bound, server)
    from crossbar_site.asgi import application
    from crossbar_site.lifecycle import start_accounting, stop_accounting

    if server == "uvicorn":
        from crossbar_site import uvicorn_server as chosen
    else:
        from crossbar_site import daphne_server as chosen  # type: ignore[no-redef]  # one of two modules with the same `run`
    # What is loaded by now (Django, the apps, the URLconf, the server: most of the process's
    # objects) lives as long as the process. Frozen, the collector no longer walks it in every
    # full collection, which the proxy's allocations set off now and then (bench/README.md,
    # "the collector's pauses"). Collected first, so that no garbage of the start is kept.
    gc.collect()
    gc.freeze()
    start_accounting()
    chosen.run(application, listening, grace=grace, lifeline=lifeline)
    if code := stop_accounting():
        raise SystemExit(code)


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A non-blocking socket listening on host:port, whose connections send without delay
    (TCP_NODELAY); with `reuse_port`, one of several (SO_REUSEPORT: the kernel spreads new
    connections evenly over them).

    Raises CommandError when the address cannot be listened on."""
    try:
        listening = socket.create_server(
            (host.strip("[]"), port), family=family(host), backlog=BACKLOG, reuse_port=reuse_port
        )
    except OSError as exc:
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    listening.setblocking(False)  # both servers take it as it is: it must not block
    # Every connection accepted on it sends small writes at once (TCP_NODELAY is inherited):
    # uvicorn sets it on each connection, Twisted never does, and there a stream's first token,
    # a small write right after its head's, waited for the client's delayed ACK (Nagle).
    listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return listening


def family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
