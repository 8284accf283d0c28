"""Serve crossbar: the gateway, the admin and the dashboard, on one address (`make run`)."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = (
        "Serve crossbar with daphne. On SIGTERM or SIGINT stop accepting connections, let "
        "requests in flight finish (up to CROSSBAR_SHUTDOWN_GRACE seconds; a second signal "
        "cuts them), write the accounting rows, and exit. See crossbar_site/serve.py."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--bind", default="127.0.0.1", help="address (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
        parser.add_argument(
            "--grace",
            type=float,
            help="seconds requests in flight may take at a stop (default CROSSBAR_SHUTDOWN_GRACE)",
        )

    def handle(
        self, *args: object, bind: str, port: int, grace: float | None, **options: object
    ) -> None:
        from crossbar_site.serve import serve
        from routing.shared.state import url_problem

        if settings.REDIS_URL and (problem := url_problem(settings.REDIS_URL)):
            raise CommandError(problem)
        serve(bind, port, grace=settings.CROSSBAR["SHUTDOWN_GRACE"] if grace is None else grace)
