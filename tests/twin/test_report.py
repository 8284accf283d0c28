"""The twin's verdicts on `auto` under its table, from the rows the gateway writes."""

from __future__ import annotations

from twin.report import verdicts
from twin.tally import Figures, Tally

from tests.helpers.history_records import record


def figures(*stays: tuple[int, int, int | None], evaluated: int = 100) -> Figures:
    """A run whose requests that waited were priced to stay (queued ms, TTFB ms, stay ms)."""
    tally = Tally()
    tally.record(record(prompt_tokens=evaluated, cached_tokens=0))
    for queued, ttfb, stay in stays:
        tally.record(record(queued_ms=queued, ttfb_ms=ttfb, patience="stay", patience_stay_ms=stay))
    tally.record(record(queued_ms=900, ttfb_ms=1000, patience="spill", patience_stay_ms=50))
    return tally.figures(["gpu1"])


def test_the_waits_that_stayed_are_told_with_their_first_token_over_the_price_they_stayed_at():
    run = figures((400, 1000, 500), (100, 300, 100), (700, 4000, 1000), (0, 90, 30))

    assert (run.stayed, run.stay_priced) == (3, 3.0)  # 2x, 3x and 4x; a request never in line
    lines = verdicts({"auto": [run], "8 s": [figures()]})  # is not a wait, nor a spill a stay

    assert lines[-1] == (
        "auto's waits in line: 3 stayed, their first token 3.00x the price they stayed at"
    )


def test_a_stay_priced_at_nothing_counts_as_priced_at_a_millisecond():
    run = figures((400, 250, 0))

    assert (run.stayed, run.stay_priced) == (1, 250.0)
