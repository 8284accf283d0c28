"""Figures a host reports reach its rows only within their columns' range: a host that says
it served 10^23 tokens from its cache gets an empty count, one warning naming it, and the
row is written with the rest of its batch (item 4 of issue 39)."""

from __future__ import annotations

import pytest

from tests.helpers.fleet import add_host, add_route, chat
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/chat/v1/chat/completions"


@pytest.mark.parametrize("said", [10**23, 2**31], ids=["beyond_any_integer", "beyond_int32"])
def test_an_absurd_token_count_from_a_host_is_stored_empty_with_one_warning_naming_it(
    gateway, fake, ledger, said
):
    add_route("chat", [add_host("odd-gpu", fake.url)])
    gateway.sync()
    fake.cache_n_said = said  # its usage and timings both say so

    for stream in (False, True):
        body = chat(f"stream {stream}", stream=stream, max_tokens=3)
        body["stream_options"] = {"include_usage": True}
        assert ledger.client.post(URL, json=body).status_code == 200

    assert ledger.statuses() == [200, 200]
    rows = ledger.rows().values_list("prompt_tokens", "cached_tokens", "completion_tokens")
    assert sorted(rows) == [(None, None, 3), (None, None, 3)]
    warnings = lambda: [  # noqa: E731
        line for line in gateway.log().splitlines() if "beyond its column" in line
    ]
    wait_until(lambda: len(warnings()) >= 2, what="the warnings")
    assert all("host odd-gpu" in line and "cached_tokens" in line for line in warnings())
