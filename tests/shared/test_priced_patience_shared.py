"""Priced patience with shared state: a gateway on Redis prices a busy home's wait from its
own figures and spills at once, as one process does (tests/proxy/test_priced_patience.py)."""

from __future__ import annotations

import pytest

from tests.helpers.gateway import running_gateway
from tests.helpers.priced_patience import fresh_hosts, spilled_at_once

pytestmark = pytest.mark.django_db(transaction=True)


def test_with_shared_state_a_busy_homes_request_spills_at_once_and_its_row_says_why(
    tmp_path, redis_url, fake, fake2
):
    home, other = fresh_hosts(fake, fake2)

    with running_gateway(tmp_path, CROSSBAR_REDIS_URL=redis_url) as gateway:
        gateway.sync()
        url = f"{gateway.url}/chat/v1/chat/completions"
        spilled, row = spilled_at_once(url, fake, fake2, home, other)

    assert (spilled.status_code, spilled.headers["x-crossbar-host"]) == (200, other)
    assert spilled.headers["x-crossbar-lease"] == "spilled"
    assert spilled.headers["x-crossbar-patience"] == (
        f"spill stay_ms={row.patience_stay_ms} spill_ms={row.patience_spill_ms}"
    )
    assert (row.placement, row.patience) == ("spilled", "spill")
    assert row.patience_stay_ms is not None and row.patience_spill_ms is not None
    assert row.patience_spill_ms < row.patience_stay_ms
    assert row.queued_ms < 1500  # not the fixed default's 2 s
