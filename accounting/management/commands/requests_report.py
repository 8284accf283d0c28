"""`manage.py requests_report`: requests, errors, latency and tokens per route, host or model."""

from __future__ import annotations

import argparse
import csv
import gc
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from django.core.management.base import (
    BaseCommand,
    CommandError,
    CommandParser,
    DjangoHelpFormatter,
)
from django.utils import timezone

from accounting.durations import before
from accounting.models import Request
from accounting.report import COLD_TURN_SHARE, COLUMNS, GROUPINGS, ROW_FIELDS, summarize

HELP = f"""\
Summarize the requests that started in a time window, one line per group.

Columns:
  requests                         rows in the window
  4xx, 5xx, 499                    errors; 499 (the client went away) is not counted in 4xx
  queued/ttfb/total p50, p95 (ms)  nearest-rank percentiles: the value at rank ceil(p% x n)
                                   of the sorted values; ttfb leaves out rows with no
                                   response head
  tokens                           prompt + completion tokens (cached prompt tokens included):
                                   what client keys' budgets count (--by client)
  prompt/cached/completion_tokens  sums over the rows that report them (unknown is not 0:
                                   - when no row of the group reports one)
  cold_turns                       requests that came back to their conversation's host
                                   (lease reused) and found less than {COLD_TURN_SHARE:.0%} of their
                                   prompt cached: the host needs more slots, more --cache-ram
                                   or --slot-prompt-similarity 0.95 (docs/config.md)
  cache_lost                       requests whose host had less of the prompt cached than
                                   the gateway's prefix index predicted (by more than a
                                   block): it lost what it was sent; recurring on one host,
                                   it needs more slots, more --cache-ram or -sps 0.95
  cache_hit                        cached / prompt tokens, over rows where both are known
  tok_per_s                        streaming rate: completion tokens / (total - ttfb) seconds,
                                   over streamed rows with both known (a non-streamed answer
                                   arrives whole, so it has no generation time to measure)

Every number is computed in Python from the rows, so SQLite and PostgreSQL agree.
"""


class _HelpFormatter(DjangoHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


class Command(BaseCommand):
    help = HELP

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--since",
            metavar="SPAN",
            help="How far back from now (or from --to): 90min, 24h, 7d. Default 24h.",
        )
        parser.add_argument(
            "--from",
            dest="start",
            metavar="WHEN",
            help="Window start, ISO date or datetime (UTC unless it has an offset).",
        )
        parser.add_argument(
            "--to",
            dest="end",
            metavar="WHEN",
            help="Window end, excluded; ISO date or datetime. Default now.",
        )
        parser.add_argument(
            "--by",
            default="route",
            metavar="NAMES",
            help=f"Group by one or more of {', '.join(GROUPINGS)}, comma separated. Default route.",
        )
        parser.add_argument(
            "--format",
            choices=["table", "csv", "json"],
            default="table",
            help="table for people (default), csv or json (a list of objects) for tools.",
        )

    def handle(self, *args: Any, **options: Any) -> str:
        start, end = _window(options["since"], options["start"], options["end"])
        by = _groupings(options["by"])
        rows = (
            Request.objects.filter(started__gte=start, started__lt=end)
            .order_by()
            .values_list(*by, *ROW_FIELDS)
        )
        with _collector_paused():
            summaries = summarize(rows.iterator(chunk_size=10_000), by)
        if options["format"] == "csv":
            return _csv(summaries, by)
        if options["format"] == "json":
            return json.dumps(summaries, indent=2)
        return _table(summaries, by, start, end)


def _window(since: str | None, start: str | None, end: str | None) -> tuple[datetime, datetime]:
    if since and start:
        raise CommandError("Give --since or --from, not both.")
    until = _moment(end, "--to") if end else timezone.now()
    if start:
        frm = _moment(start, "--from")
    else:
        try:
            frm = before(until, since or "24h")
        except ValueError as exc:
            raise CommandError(f"--since: {exc}") from None
    if frm >= until:
        raise CommandError(
            f"The window is empty: {frm:%Y-%m-%d %H:%M:%S} is not before {until:%Y-%m-%d %H:%M:%S}."
        )
    return frm, until


def _moment(text: str, option: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise CommandError(
            f"{option}: “{text}” is not an ISO date or datetime (e.g. 2026-11-30 or "
            "2026-11-30T14:00)."
        ) from None
    return moment if timezone.is_aware(moment) else moment.replace(tzinfo=UTC)


def _groupings(text: str) -> list[str]:
    by = [name.strip() for name in text.split(",")]
    unknown = [name for name in by if name not in GROUPINGS]
    if unknown:
        raise CommandError(
            f"--by: cannot group by “{', '.join(unknown)}”; choose from {', '.join(GROUPINGS)}."
        )
    if len(set(by)) != len(by):
        raise CommandError(f"--by: “{text}” names a field twice.")
    return by


@contextmanager
def _collector_paused() -> Iterator[None]:
    # A million rows arrive as a million short-lived tuples; the cyclic garbage collector
    # would rescan them over and over and cost a quarter of the report's time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _csv(summaries: list[dict[str, Any]], by: list[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[*by, *COLUMNS], lineterminator="\n")
    writer.writeheader()
    writer.writerows(summaries)
    return out.getvalue().rstrip("\n")


def _table(summaries: list[dict[str, Any]], by: list[str], start: datetime, end: datetime) -> str:
    title = f"Requests from {start:%Y-%m-%d %H:%M:%S} to {end:%Y-%m-%d %H:%M:%S} UTC"
    if not summaries:
        return f"{title}: none."
    header = [*by, *COLUMNS]
    lines = [header] + [[_cell(row[name], name) for name in header] for row in summaries]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    grouped = len(by)

    def aligned(line: list[str]) -> str:
        cells = [
            cell.ljust(width) if i < grouped else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([f"{title}, by {', '.join(by)}:", "", *map(aligned, lines)])


def _cell(value: Any, name: str) -> str:
    if value is None or value == "":
        return "-"
    if name == "cache_hit":
        return f"{value:.1%}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
