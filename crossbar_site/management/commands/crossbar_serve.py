"""Serve crossbar: the gateway, the admin and the dashboard, on one address (`make run`)."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = (
        "Serve crossbar with daphne or uvicorn (CROSSBAR_SERVER). On SIGTERM or SIGINT: "
        "/health answers draining while requests in flight finish (up to "
        "CROSSBAR_SHUTDOWN_GRACE seconds; a second signal cuts them), then stop listening, "
        "write the accounting rows, and exit 0 (75 when rows were left in the spool). "
        "See crossbar_site/serve.py."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--bind", default="127.0.0.1", help="address (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
        parser.add_argument(
            "--server", help="daphne or uvicorn (default CROSSBAR_SERVER, else daphne)"
        )
        parser.add_argument(
            "--grace",
            type=float,
            help="seconds requests in flight may take at a stop (default CROSSBAR_SHUTDOWN_GRACE)",
        )
        parser.add_argument(
            "--check",
            action="store_true",
            help="check the server, CROSSBAR_WORKERS and CROSSBAR_REDIS_URL, then exit "
            "(`make run` does, before it migrates)",
        )

    def handle(
        self,
        *args: object,
        bind: str,
        port: int,
        server: str | None,
        grace: float | None,
        check: bool,
        **options: object,
    ) -> None:
        from crossbar_site import serve

        if check:
            serve.check(server)
            return
        grace = settings.CROSSBAR["SHUTDOWN_GRACE"] if grace is None else grace
        serve.serve(bind, port, grace=grace, server=server)
