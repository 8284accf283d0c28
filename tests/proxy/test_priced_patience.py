"""Priced patience through the real gateway and fake llama-servers: a busy home's request
stays in line or spills, as the hosts' own answers price it, and its row and response say
which, with both prices.

The fake evaluates 10,000 prompt tokens a second (its `timings.prompt_ms`), and its answers
take as long as their tokens' delays. Each test names its hosts afresh: the session's
gateway keeps the figures of every host it has served.
"""

from __future__ import annotations

import time

import httpx
import pytest
from django.utils import timezone

from hosts.models import Host
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.asking import holding, slow
from tests.helpers.fleet import chat
from tests.helpers.priced_patience import fresh_hosts, spilled_at_once, waited_row

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_busy_homes_request_spills_at_once_when_the_cold_start_is_priced_sooner(
    gateway, fake, fake2
):
    home, other = fresh_hosts(fake, fake2)
    gateway.sync()

    spilled, row = spilled_at_once(f"{gateway.url}/chat/v1/chat/completions", fake, fake2,
                                   home, other)  # fmt: skip

    assert spilled.status_code == 200
    assert (spilled.headers["x-crossbar-host"], spilled.headers["x-crossbar-lease"]) == (
        other, "spilled",
    )  # fmt: skip
    assert spilled.headers["x-crossbar-placement"] == "spilled"
    said = spilled.headers["x-crossbar-patience"]
    assert said == f"spill stay_ms={row.patience_stay_ms} spill_ms={row.patience_spill_ms}"
    assert (row.placement, row.lease, row.patience) == ("spilled", "spilled", "spill")
    assert row.patience_stay_ms is not None and row.patience_stay_ms >= 100  # 10 tokens, 0.1 s
    assert row.patience_spill_ms is not None and row.patience_spill_ms < row.patience_stay_ms
    assert row.queued_ms < 1500  # it did not wait for the fixed default (2 s) to pass
    assert f"patience={said}" in gateway.log()


def test_a_busy_homes_request_stays_when_the_free_slot_elsewhere_is_its_hosts_own_conversations(
    gateway, fake, fake2
):
    """The other host's free slot is the one its own conversation comes back to: a spill would
    hold it for a whole service there (some 2 s, that conversation's last answer), which is
    priced into the spill, so the request waits at home for its much shorter line instead."""
    home, other = fresh_hosts(fake, fake2)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    fake.token_delay = 0.1
    first = httpx.post(url, json=chat("mine", max_tokens=4), timeout=10)
    assert first.headers["x-crossbar-host"] == home
    fake2.token_delay = 0.1
    theirs = httpx.post(url, json=chat("theirs", max_tokens=20), timeout=10)  # 2 s held
    assert theirs.headers["x-crossbar-host"] == other
    since = timezone.now()

    with holding(url, slow("mine", tokens=6), fake):  # home busy for some 0.6 s
        stayed = httpx.post(url, json=chat("mine", max_tokens=2), timeout=10)

    assert stayed.status_code == 200
    assert stayed.headers["x-crossbar-host"] == home
    row = waited_row(home, since)
    assert row.patience == "stay"
    # The cold start there is well under a millisecond; the rest is theirs' service.
    assert row.patience_spill_ms is not None and row.patience_spill_ms >= 1900
    assert row.patience_stay_ms is not None and row.patience_stay_ms < row.patience_spill_ms


def test_a_busy_homes_request_stays_when_the_cold_start_elsewhere_is_priced_longer(
    gateway, fake, fake2
):
    home, other = fresh_hosts(fake, fake2)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    document = " ".join(f"clause{i}" for i in range(20_000))  # 2 s to evaluate cold
    first = httpx.post(url, json=chat("mine?", system=document, max_tokens=2), timeout=10)
    assert first.headers["x-crossbar-host"] == home
    theirs = httpx.post(url, json=chat("theirs", max_tokens=2), timeout=10)
    assert theirs.headers["x-crossbar-host"] == other
    since = timezone.now()
    fake.token_delay = 0.05

    busy = chat("mine?", system=document, stream=True, max_tokens=10)  # the same conversation
    with holding(url, busy, fake):  # home busy for some 0.5 s
        stayed = httpx.post(url, json=chat("mine?", system=document, max_tokens=2), timeout=10)

    assert stayed.status_code == 200
    assert stayed.headers["x-crossbar-host"] == home
    assert stayed.headers["x-crossbar-placement"] == "home"
    row = waited_row(home, since)
    assert row.patience == "stay"
    assert row.patience_spill_ms is not None and row.patience_spill_ms >= 1000
    assert row.patience_stay_ms is not None and row.patience_stay_ms < row.patience_spill_ms
    assert stayed.headers["x-crossbar-patience"] == (
        f"stay stay_ms={row.patience_stay_ms} spill_ms={row.patience_spill_ms}"
    )


def test_a_busy_homes_request_stays_behind_a_request_near_its_end(gateway, fake, fake2):
    # A slot at home is held 2 s (its first answer), the other host would evaluate the
    # conversation cold in 1.2 s: behind a request just begun, spilling is sooner; behind one
    # 1.3 s into its slot, staying is (some 0.7 s left of the 2 s it is expected to take).
    home, other = fresh_hosts(fake, fake2)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    document = " ".join(f"clause{i}" for i in range(12_000))  # 1.2 s to evaluate cold
    fake.token_delay = 0.1
    first = httpx.post(url, json=chat("near", system=document, max_tokens=20), timeout=10)
    assert first.headers["x-crossbar-host"] == home
    theirs = httpx.post(url, json=chat("theirs", max_tokens=2), timeout=10)
    assert theirs.headers["x-crossbar-host"] == other
    since = timezone.now()

    # It runs 3 s, longer than home's 2 s: the request below finds it still running.
    busy = chat("near", system=document, stream=True, max_tokens=30)
    with holding(url, busy, fake):
        time.sleep(1.3)
        stayed = httpx.post(url, json=chat("near", system=document, max_tokens=2), timeout=10)

    assert stayed.status_code == 200
    assert stayed.headers["x-crossbar-host"] == home
    row = waited_row(home, since)
    assert row.patience == "stay"
    assert row.patience_spill_ms is not None and row.patience_spill_ms >= 1000
    # Not the 2 s a whole service would price it at: what the running request has left.
    assert row.patience_stay_ms is not None and row.patience_stay_ms < 1000


def test_a_host_moved_to_another_machine_is_priced_afresh(gateway, fake, fake2):
    home, other = fresh_hosts(fake, fake2)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    spilled, _ = spilled_at_once(url, fake, fake2, home, other)
    assert spilled.headers["x-crossbar-patience"].startswith("spill ")

    with FakeLlamaServer() as third:
        moved = Host.objects.get(name=other)
        moved.url = third.url  # the same name, another machine: nothing measured there yet
        moved.save()
        gateway.sync()
        with holding(url, slow("mine", tokens=30), fake):  # home busy for some 3 s
            again = httpx.post(url, json=chat("mine", max_tokens=2), timeout=10)

    assert (again.headers["x-crossbar-host"], again.headers["x-crossbar-lease"]) == (
        other, "spilled",
    )  # fmt: skip
    assert again.headers["x-crossbar-patience"].startswith("default ")  # after the fixed 2 s
    assert float(again.headers["x-crossbar-queued-ms"]) >= 2000
