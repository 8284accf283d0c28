"""The twin's verdicts on `auto` under its table: how its waits in line compared with their
prices, as the runtime's figures were taught them."""

from __future__ import annotations

from twin.gateway import WatchedFigures
from twin.report import verdicts
from twin.tally import Figures, Tally, with_waits

from tests.helpers.history_records import record


def run(waits: list[tuple[float, float]]) -> Figures:
    tally = Tally()
    tally.record(record())
    return with_waits(tally.figures(["gpu1"]), waits)


def test_the_waits_are_told_as_their_median_over_their_price_and_those_priced_at_nothing():
    auto = run([(1.0, 2.0), (2.0, 6.0), (1.0, 4.0), (0.0, 28.0)])  # 2x, 3x, 4x, and nothing

    assert (auto.waits, auto.priced_nothing, auto.wait_over_price) == (4, 1, 3.0)
    lines = verdicts({"auto": [auto], "8 s": [run([])]})
    assert lines[-1] == (
        "auto's waits in line: 4, each a median 3.00x what it was priced at as it began; "
        "1 priced at nothing"
    )


def test_the_twins_figures_keep_every_wait_they_are_taught_and_still_learn_from_it():
    learnt = WatchedFigures()
    learnt.waited("gpu1", "m", priced=0.0, actual=3.0)
    learnt.waited("gpu1", "m", priced=2.0, actual=5.0)

    assert learnt.waits == [(0.0, 3.0), (2.0, 5.0)]
    assert learnt.lateness("gpu1", "m") == 2.5  # the product's own reading: priced 0 teaches none
