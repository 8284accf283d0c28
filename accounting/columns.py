"""What a `Request` row's integer columns hold, and a record fitted to them.

A figure a host reports (its token counts, and what the gateway derives from them) can be any
number JSON spells. The columns are Django's integer fields, whose range is PostgreSQL's
integer (`PositiveIntegerField`: 0 to 2^31 - 1): a value past it makes PostgreSQL refuse the
row, and SQLite too once it is past 64 bits. The range is the same on every database, so a
row stored on SQLite is one PostgreSQL takes as well.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeVar

from django.db.backends.base.operations import BaseDatabaseOperations

from accounting.models import Request

log = logging.getLogger("accounting.recorder")

Row = TypeVar("Row")

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


def within_columns(row: Row) -> Row:
    """`row` (a dataclass with `Request`'s field names) as its columns can hold it.

    An integer beyond its column's range becomes empty, or, where the column may not be empty,
    the nearest value it holds; one warning names the row's host and each such figure. The same
    `row` comes back when every figure fits. Cheap enough for the event loop (a dozen
    comparisons); safe from any thread."""
    changes: dict[str, Any] = {}
    said: list[str] = []
    for name, lowest, highest, nullable in _INTEGERS:
        value = getattr(row, name, None)
        if value is None or lowest <= value <= highest:
            continue
        fitted = None if nullable else min(max(value, lowest), highest)
        changes[name] = fitted
        said.append(f"{name}={_shown(value)} (stored {'empty' if fitted is None else fitted})")
    if not changes:
        return row
    log.warning(
        "accounting: host %s, route %s: figures beyond its column's range: %s",
        getattr(row, "host", "") or "-",
        getattr(row, "route", "") or "-",
        ", ".join(said),
    )
    return dataclasses.replace(row, **changes)  # type: ignore[type-var]


def _shown(value: int) -> str:
    text = str(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text)} digits)"
