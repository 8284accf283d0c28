"""`manage.py requests_prune --older-than 30d`: delete old request rows, a batch at a time."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from accounting.durations import ACCEPTED, before
from accounting.models import Request

# Each batch is its own short transaction, so the recorder's writes interleave with a long
# prune instead of waiting for all of it (SQLite has one writer at a time).
BATCH = 10_000
# What `--dry-run` alone counts, to help choose an --older-than.
AGES = ("1d", "7d", "30d", "90d")


class Command(BaseCommand):
    help = (
        "Delete requests that started before a cutoff, in batches of 10,000. "
        "--dry-run alone counts the requests older than 1, 7, 30 and 90 days."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            metavar="AGE",
            help=f"Age of the oldest request to keep: 90min, 24h, 30d, 3mo. Units: {ACCEPTED}.",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would be deleted; delete nothing."
        )

    def handle(self, *args: Any, **options: Any) -> str:
        age, dry_run = options["older_than"], options["dry_run"]
        if age is None:
            if dry_run:
                return _ages_report()
            raise CommandError(
                "--older-than is required to delete (e.g. --older-than 30d); "
                "--dry-run alone counts the requests by age."
            )
        cutoff = _cutoff(age)
        old = Request.objects.filter(started__lt=cutoff)
        if dry_run:
            return f"Would delete {old.count()} requests started before {_when(cutoff)}."
        deleted = 0
        while batch := Request.objects.filter(pk__in=old.values("pk")[:BATCH]).delete()[0]:
            deleted += batch
            if options["verbosity"] > 1:
                self.stdout.write(f"Deleted {deleted} so far.")
        return f"Deleted {deleted} requests started before {_when(cutoff)}."


def _cutoff(age: str) -> datetime:
    try:
        return before(timezone.now(), age)
    except ValueError as exc:
        raise CommandError(f"--older-than: {exc}") from None


def _when(moment: datetime) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


def _ages_report() -> str:
    now = timezone.now()
    lines = [f"{Request.objects.count()} requests in all; nothing deleted. Older than:"]
    for age in AGES:
        count = Request.objects.filter(started__lt=before(now, age)).count()
        lines.append(f"  {age:>4}  {count}")
    lines.append("Delete with --older-than AGE (e.g. --older-than 30d).")
    return "\n".join(lines)
