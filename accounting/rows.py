"""One request's row as the proxy hands it over, fitted to its columns, and how it goes to
the database (one INSERT for a batch) or to the spool (a JSON object).

Every figure in a row is held within its column's range before it reaches the database. The
range is the one Django gives the column (`PositiveIntegerField`: PostgreSQL's integer, 0 to
2^31 - 1) on every database, so a row SQLite stores PostgreSQL takes as well: a figure a host
reports (its token counts, and what the gateway derives from them) can be any number JSON
spells, and past the range PostgreSQL refuses the row (SQLite too, past 64 bits).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from django.db import connection, models, transaction
from django.db.backends.base.operations import BaseDatabaseOperations

from accounting.models import Request

log = logging.getLogger("accounting.recorder")

# A write waits at most this long for a lock (SQLite's busy timeout, PostgreSQL's statement
# timeout), so that a stop's deadline is kept: the writer retries, and gives up in time.
ATTEMPT_SECONDS = 2.0


@dataclass(slots=True)
class RequestRecord:
    """One request as the proxy hands it over; the fields are `Request`'s."""

    route: str
    fingerprint: str
    model: str
    host: str
    started: datetime
    queued_ms: int
    ttfb_ms: int | None
    total_ms: int
    status: int
    streamed: bool
    lease: str
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    error: str = ""
    client: str = ""
    fallback: str = ""
    placement: str = ""
    code: str = ""
    refused_by: str = ""  # space-separated host names
    predicted_cached_blocks: int | None = None
    reported_cached_blocks: int | None = None
    patience: str = ""
    patience_stay_ms: int | None = None
    patience_spill_ms: int | None = None


_FIELDS = tuple(f.name for f in fields(RequestRecord))
# A string longer than its column makes PostgreSQL refuse the row; a client-sent model name
# can be any length, so strings are cut to fit instead.
_MAX_LENGTHS = {
    f.name: f.max_length
    for f in Request._meta.get_fields()
    if isinstance(f, models.CharField) and f.name in _FIELDS and f.max_length is not None
}


def _values(row: RequestRecord) -> list[Any]:
    """The row's column values, in `_FIELDS` order, as the database takes them."""
    values: list[Any] = []
    for name in _FIELDS:
        value = getattr(row, name)
        if isinstance(value, str):
            if "\x00" in value:
                # PostgreSQL refuses NUL in text, and a client can send one (`%00` in a path).
                value = value.replace("\x00", "\ufffd")
            limit = _MAX_LENGTHS.get(name)
            if limit is not None and len(value) > limit:
                value = value[:limit]
        elif isinstance(value, datetime):
            value = connection.ops.adapt_datetimefield_value(value)
        values.append(value)
    return values


def _insert() -> str:
    quote = connection.ops.quote_name
    column = {field.name: field.column for field in Request._meta.concrete_fields}
    columns = ", ".join(quote(column[name]) for name in _FIELDS)
    placeholders = ", ".join(["%s"] * len(_FIELDS))
    return f"INSERT INTO {quote(Request._meta.db_table)} ({columns}) VALUES ({placeholders})"


def save(rows: list[RequestRecord]) -> None:
    """Insert `rows` in one transaction: all of them, or none (IntegrityError, DataError).

    The INSERT `bulk_create` runs, without a model instance per row and the SQL assembled
    value by value, which were three quarters of the writer's CPU (bench/README.md, issue 22).
    Every column is one of `RequestRecord`'s fields, each a str, int, bool, None or an aware
    datetime: the database driver takes those as they are but the datetime, which Django's
    backend adapts as the model field would (SQLite: UTC text)."""
    timeout_ms = int(ATTEMPT_SECONDS * 1000)
    if connection.vendor == "sqlite":  # BEGIN IMMEDIATE waits for the lock, before any SET
        with connection.cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout = {timeout_ms}")
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"SET LOCAL statement_timeout = {timeout_ms}")
        cursor.executemany(_insert(), [_values(row) for row in rows])


def first_line(exc: BaseException) -> str:
    # PostgreSQL puts the failing row's values on a DETAIL line; only the first line is logged.
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


# (name, lowest, highest, nullable) of each integer column
_INTEGERS = tuple(
    (
        field.name,
        *BaseDatabaseOperations.integer_field_ranges[field.get_internal_type()],
        field.null,
    )
    for field in Request._meta.concrete_fields
    if field.get_internal_type() in BaseDatabaseOperations.integer_field_ranges
    and not field.primary_key
)


_RANGES = {name: (lowest, highest) for name, lowest, highest, _ in _INTEGERS}


def fits(column: str, value: int | None) -> int | None:
    """`value` when the Request row's integer `column` can hold it, else None: what a figure
    beyond its column is worth to anything else that reads a host's figures."""
    lowest, highest = _RANGES[column]
    return value if value is not None and lowest <= value <= highest else None


def within_columns(row: RequestRecord) -> RequestRecord:
    """`row` as its columns can hold it.

    An integer beyond its column's range becomes empty, or, where the column may not be empty,
    the nearest value it holds; one warning names the row's host and each such figure. The same
    `row` comes back when every figure fits. Cheap enough for the event loop (a dozen
    comparisons); safe from any thread."""
    changes: dict[str, Any] = {}
    said: list[str] = []
    for name, lowest, highest, nullable in _INTEGERS:
        value = getattr(row, name)
        if value is None or lowest <= value <= highest:
            continue
        fitted = None if nullable else min(max(value, lowest), highest)
        changes[name] = fitted
        said.append(f"{name}={_shown(value)} (stored {'empty' if fitted is None else fitted})")
    if not changes:
        return row
    log.warning(
        "accounting: host %s, route %s: figures beyond its column's range: %s",
        row.host or "-",
        row.route or "-",
        ", ".join(said),
    )
    return dataclasses.replace(row, **changes)


def _shown(value: int) -> str:
    text = str(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text)} digits)"


def spooled(row: RequestRecord) -> dict[str, Any]:
    """`row` as a line of the spool holds it (JSON: the time as ISO 8601 text)."""
    line = dataclasses.asdict(row)
    line["started"] = row.started.isoformat()
    return line


def from_spool(line: dict[str, Any]) -> RequestRecord | None:
    """The row a spool's line holds; None for a line that is not one (logged by the caller).
    Fields a later version added take their defaults; unknown ones are ignored."""
    try:
        values = {name: line[name] for name in _FIELDS if name in line}
        values["started"] = datetime.fromisoformat(values["started"])
        return within_columns(RequestRecord(**values))
    except (KeyError, TypeError, ValueError):
        return None
