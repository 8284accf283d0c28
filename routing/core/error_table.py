"""The README's table of error codes, written from where the codes are defined.

Every `GatewayError` class that is imported (its code, status and `when`), and the codes the
proxy writes without raising (`errors.OUTCOMES`), one row per code, by status. The README holds
the table between two markers; `manage.py crossbar_error_table` rewrites it there, and
tests/config/test_error_table.py fails when the file's table is not this one.
"""

from __future__ import annotations

from collections.abc import Iterator

from routing.core.errors import OUTCOMES, CodeRow, GatewayError

START = "<!-- error-codes: written by manage.py crossbar_error_table -->"
END = "<!-- error-codes: end -->"


def error_classes(root: type[GatewayError] = GatewayError) -> Iterator[type[GatewayError]]:
    """`root` and every subclass of it imported so far, parents first."""
    yield root
    for sub in root.__subclasses__():
        yield from error_classes(sub)


def rows() -> list[CodeRow]:
    """One row per code: the first class that sets it (a subclass that only inherits its
    parent's code, such as `HostDown`, adds none), then the outcomes."""
    found: dict[str, CodeRow] = {}
    for cls in error_classes():
        if cls.code not in found:
            found[cls.code] = CodeRow(str(cls.status), cls.code, cls.when)
    for outcome in OUTCOMES:
        found.setdefault(outcome.code, outcome)
    return sorted(found.values(), key=lambda row: (row.status[:3], row.code))


def table() -> str:
    lines = ["| status | code | when |", "|---|---|---|"]
    lines += [f"| {row.status} | `{row.code}` | {row.when} |" for row in rows()]
    return "\n".join(lines)


def with_table(text: str) -> str:
    """`text` (the README) with the table between its markers written anew. Raises
    ValueError when the markers are missing."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the markers {START!r} and {END!r} are not both in the file")
    return f"{head}{START}\n{table()}\n{END}{tail}"
