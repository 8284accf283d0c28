"""Serve an ASGI application with crossbar_serve's servers: floors on `crossbar_serve`, `uvicorn`.

    python bench/floor_serve.py --port PORT floor_app:application
    python bench/floor_serve.py --server uvicorn --port PORT floor_app:application

`manage.py crossbar_serve` runs `crossbar_site.daphne_server.GatewayServer` (daphne's server
with backpressure and capped bodies; `crossbar_site.serve.GatewayServer` in sources before it)
around crossbar's application, and with `--server uvicorn` crossbar_site/uvicorn_server.py's
uvicorn; this runs the same server around another one, so a floor and crossbar differ by the
application alone. Django is set up with crossbar's settings because the server modules read
them (and daphne's Twisted
reactor is installed by that set-up, as in crossbar_serve); the bare floor itself never uses
Django. The crossbar source whose server this is must be on sys.path (bench_gateway.py puts
it in PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("app", help="module:attribute of the ASGI application")
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grace", type=float, default=5.0, help="seconds at SIGTERM")
    parser.add_argument("--server", choices=("daphne", "uvicorn"), default="daphne")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crossbar_site.settings")
    import django

    django.setup()
    try:
        from crossbar_site import daphne_server, uvicorn_server
        from crossbar_site.serve import listen
    except ImportError:  # a source from before crossbar_site/daphne_server.py
        if args.server != "daphne":
            sys.exit("this crossbar source serves no uvicorn of its own (crossbar_site/serve.py)")
        _serve_before_daphne_server(args)
        return
    listening = listen(args.bind, args.port)
    server = uvicorn_server if args.server == "uvicorn" else daphne_server
    server.run(_application(args.app), listening, grace=args.grace, lifeline=None)


def _application(spec: str) -> Any:
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute or "application")


def _serve_before_daphne_server(args: argparse.Namespace) -> None:
    from daphne.endpoints import build_endpoint_description_strings
    from django.conf import settings

    try:
        from crossbar_site.serve import (  # type: ignore[attr-defined]  # an older source's
            GatewayServer,
            _finish_tasks,
        )
    except ImportError:
        sys.exit("this crossbar source has no crossbar_site/serve.py: use --server daphne")
    server = GatewayServer(
        _application(args.app),
        build_endpoint_description_strings(host=args.bind, port=args.port),
        grace=args.grace,
        stall_timeout=settings.CROSSBAR["STREAM_IDLE_TIMEOUT"],
    )
    server.run()
    _finish_tasks(asyncio.get_event_loop())


if __name__ == "__main__":
    main()
