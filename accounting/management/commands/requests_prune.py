"""`manage.py requests_prune --older-than 30d`: delete old request rows, a batch at a time."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from accounting.durations import before
from accounting.models import Request

# Each batch is its own short transaction, so the recorder's writes interleave with a long
# prune instead of waiting for all of it (SQLite has one writer at a time).
BATCH = 10_000


class Command(BaseCommand):
    help = "Delete requests that started before a cutoff, in batches of 10,000."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            required=True,
            help="Age of the oldest request to keep: 90m, 24h, 30d.",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would be deleted; delete nothing."
        )

    def handle(self, *args: Any, **options: Any) -> str:
        try:
            cutoff = before(timezone.now(), options["older_than"])
        except ValueError as exc:
            raise CommandError(f"--older-than: {exc}") from None
        old = Request.objects.filter(started__lt=cutoff)
        when = f"{cutoff:%Y-%m-%d %H:%M:%S} UTC"
        if options["dry_run"]:
            return f"Would delete {old.count()} requests started before {when}."
        deleted = 0
        while batch := Request.objects.filter(pk__in=old.values("pk")[:BATCH]).delete()[0]:
            deleted += batch
            if options["verbosity"] > 1:
                self.stdout.write(f"Deleted {deleted} so far.")
        return f"Deleted {deleted} requests started before {when}."
