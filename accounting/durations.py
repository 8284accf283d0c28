"""Spans of time as operators type them on the command line: `90s`, `15min`, `24h`, `30d`.

`m` alone is refused: an operator reads `1m` as a month as readily as a minute, and a prune
that keeps one minute instead of one month cannot be undone.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

# A month is 30 days: `requests_prune --older-than 1mo` needs one fixed length, not a calendar.
_UNITS = {
    "s": timedelta(seconds=1),
    "min": timedelta(minutes=1),
    "h": timedelta(hours=1),
    "d": timedelta(days=1),
    "mo": timedelta(days=30),
}
ACCEPTED = "s, min, h, d or mo (30 days)"
_PATTERN = re.compile(r"(\d+)\s*([a-z]+)")


def parse(duration: str) -> timedelta:
    """The span `duration` names (e.g. `24h`, `15min`, `3mo`).

    Raises ValueError, with a message fit for the operator, for anything but a positive whole
    number followed by one of the units in `ACCEPTED`; `m` gets its own message.
    """
    match = _PATTERN.fullmatch(duration.strip().lower())
    if match and match[2] == "m":
        raise ValueError(
            f"“{duration}” is ambiguous: write {match[1]}min for minutes or {match[1]}mo for "
            f"months (30 days). Units: {ACCEPTED}."
        )
    if not match or match[2] not in _UNITS or int(match[1]) == 0:
        raise ValueError(
            f"“{duration}” is not a duration: give a positive whole number and a unit, "
            f"{ACCEPTED} (e.g. 90min, 24h, 30d)."
        )
    try:
        return int(match[1]) * _UNITS[match[2]]
    except OverflowError:
        raise ValueError(f"“{duration}” is too long.") from None


def before(moment: datetime, duration: str) -> datetime:
    """The moment `duration` (e.g. `24h`) before `moment`; ValueError as `parse`, and for spans
    reaching back before the year 1."""
    span = parse(duration)
    try:
        return moment - span
    except OverflowError:
        raise ValueError(f"“{duration}” reaches back too far.") from None
