"""What an answer teaches the runtime (routing/proxy/learning.py)."""

from __future__ import annotations

import pytest

from routing.core.tee import Usage
from routing.proxy.learning import as_stored


@pytest.mark.parametrize(
    ("said", "taught"),
    [
        (Usage(120, 100, 8), Usage(120, 100, 8)),
        (Usage(10**23, 100, 8), Usage(None, 100, 8)),
        (Usage(120, 2**31, -1), Usage(120, None, None)),
        (Usage(None, None, None), Usage(None, None, None)),
    ],
)
def test_a_count_no_row_could_hold_teaches_nothing(said: Usage, taught: Usage) -> None:
    # An absurd count from a host once taught priced patience an absurd prompt speed for that
    # host, and every later wait there was priced at 2^31-1 ms.
    assert as_stored(said) == taught
