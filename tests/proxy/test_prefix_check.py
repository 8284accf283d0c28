"""One request's turn of the prefix index's loop: the prediction, then the host's word."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from routing.core.prefixes import BLOCK_CHARS, Prefix, PrefixIndex
from routing.core.tee import Usage
from routing.proxy.prefix_check import predicted, settled
from routing.proxy.record import Arrival, Trail

CHAIN = (11, 12, 13, 14, 15, 16, 17, 18)
PROMPT = Prefix(CHAIN, len(CHAIN) * BLOCK_CHARS, BLOCK_CHARS)  # 8 blocks: 100 tokens each here


def runtime(index: PrefixIndex) -> Any:
    return cast(Any, SimpleNamespace(prefixes=index))  # the one part of a runtime used here


def placed(index: PrefixIndex) -> Trail:
    return predicted(Trail(Arrival(), host="gpu1", model="m", prefix=PROMPT), runtime(index))


def test_an_answer_teaches_the_index_what_the_host_now_holds():
    index = PrefixIndex(100)
    trail = placed(index)

    ended = settled(trail, runtime(index), Usage(800, 0, 4), 200)

    assert (trail.predicted_blocks, ended.reported_blocks) == (0, 0)
    assert index.match("gpu1", "m", CHAIN) == 8
    assert placed(index).predicted_blocks == 8


def test_a_failed_answer_that_reported_less_than_predicted_corrects_and_teaches_nothing():
    index = PrefixIndex(100)
    index.learn("gpu1", "m", CHAIN)
    trail = placed(index)

    ended = settled(trail, runtime(index), Usage(800, 300, None), 502)

    assert (trail.predicted_blocks, ended.reported_blocks) == (8, 3)
    assert index.match("gpu1", "m", CHAIN) == 3


def test_a_host_that_reports_nothing_leaves_the_index_as_it_was():
    index = PrefixIndex(100)
    trail = placed(index)

    ended = settled(trail, runtime(index), Usage(None, None, None), 200)

    assert ended.reported_blocks is None
    assert len(index) == 0


def test_a_request_without_a_prompt_gets_no_prediction():
    index = PrefixIndex(100)
    index.learn("gpu1", "m", CHAIN)

    trail = predicted(Trail(Arrival(), host="gpu1", model="m"), runtime(index))

    assert trail.predicted_blocks is None
    assert settled(trail, runtime(index), Usage(800, 800, 4), 200).reported_blocks is None
