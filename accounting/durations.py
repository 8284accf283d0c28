"""Spans of time as operators type them on the command line: `90s`, `15m`, `24h`, `30d`."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
_PATTERN = re.compile(r"(\d+)([smhd])")


def before(moment: datetime, duration: str) -> datetime:
    """The moment `duration` (e.g. `24h`) before `moment`.

    Raises ValueError, with a message fit for the operator, for anything but a positive whole
    number followed by s, m, h or d, and for spans reaching back before the year 1.
    """
    match = _PATTERN.fullmatch(duration.strip().lower())
    if not match or int(match[1]) == 0:
        raise ValueError(
            f"“{duration}” is not a duration: give a positive whole number and a unit, "
            "s, m, h or d (e.g. 90m, 24h, 30d)."
        )
    try:
        return moment - timedelta(**{_UNITS[match[2]]: int(match[1])})
    except OverflowError:
        raise ValueError(f"“{duration}” reaches back too far.") from None
