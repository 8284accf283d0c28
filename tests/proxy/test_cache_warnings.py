"""A warning about a host's cache is a true one: what a new operator does with the README's
fake llama-server (more conversations than slots, a host stopped and started) warns of nothing,
since the fake keeps caches as a llama-server started as docs/config.md says does (`-np`, a
`--cache-ram`, `--slot-prompt-similarity 0.95`).

What the operator sees: the host's row in the admin's host list, and the metrics behind the
dashboard's cards (`crossbar_cache_lost_total` feeds the "cache lost" figure and its hint).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hosts.actions import set_draining
from tests.helpers.asking import conversation, turn
from tests.helpers.fleet import MODEL, add_host, add_route
from tests.helpers.gateway import signed_in
from tests.helpers.observe import series, slot_naming, wait_for_health_poll, wait_for_host_state

pytestmark = pytest.mark.django_db(transaction=True)

WARNINGS = ("crossbar_cache_lost_total", "crossbar_shared_slot_lost")


def openings(count: int) -> list[str]:
    """The first questions of `count` conversations, none starting as another does, each a few
    of the prefix index's blocks long (what a lost cache is counted in)."""
    return [f"topic{i} " + f"tell me more about topic {i}, at length. " * 20 for i in range(count)]


def warned(gateway) -> dict[str, float]:
    return series(gateway.url, WARNINGS)


def host_row(gateway) -> str:
    admin = signed_in(gateway)
    try:
        return admin.get("/admin/hosts/host/").text
    finally:
        admin.close()


def test_more_conversations_than_slots_on_the_fake_warn_of_nothing(gateway, fake, admin_user):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (4, 8)})])  # its 4 slots
    gateway.sync()
    wait_for_health_poll(fake)  # its /props said its slots: they are named
    before = warned(gateway)
    firsts = openings(10)

    for opening in firsts:
        turn(gateway, opening)
    for later in ("and then?", "and after that?"):
        for opening in firsts:
            turn(gateway, opening, later)

    assert warned(gateway) == before
    assert slot_naming(gateway.url) == {f"gpu1/{MODEL}": 1.0}
    assert "⚠" not in host_row(gateway)


def test_a_host_stopped_and_started_again_counts_no_lost_cache(gateway, fake, admin_user):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (4, 8)})])
    gateway.sync()
    wait_for_health_poll(fake)
    firsts = openings(4)
    for opening in firsts:
        turn(gateway, opening)
    before = warned(gateway)

    fake.fail_mode = "refuse"  # stopped: every connect refused
    wait_for_host_state(gateway.url, "gpu1", "down")
    fake.forget_cache()  # started again, with nothing cached
    fake.fail_mode = None
    wait_for_host_state(gateway.url, "gpu1", "up")
    for opening in firsts:
        turn(gateway, opening, "and then?")

    # The restart emptied its cache: known, so no answer after it is a loss to warn of.
    assert warned(gateway) == before
    assert slot_naming(gateway.url) == {f"gpu1/{MODEL}": 1.0}
    assert "⚠" not in host_row(gateway)


def test_bursts_past_the_slots_and_a_drain_across_two_hosts_warn_of_nothing(
    gateway, fake, fake2, admin_user
):
    hosts = [
        add_host(name, f.url, models={MODEL: (4, 2)})
        for name, f in (("gpu1", fake), ("gpu2", fake2))
    ]
    add_route("chat", hosts)
    gateway.sync()
    wait_for_health_poll(fake)
    wait_for_health_poll(fake2)
    fake.token_delay = fake2.token_delay = 0.02
    before = warned(gateway)
    firsts = openings(16)

    def burst(*later: str) -> None:
        # 16 at once on 8 slots and 4 queue places: some wait, some spill, some are refused.
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda opening: burst_turn(gateway, opening, *later), firsts))

    burst()
    burst("and then?")
    set_draining(["gpu1"], True)
    gateway.sync()
    burst("and then?", "and after the drain?")
    set_draining(["gpu1"], False)
    gateway.sync()
    burst("and then?", "and after the drain?", "and now?")

    assert warned(gateway) == before
    assert slot_naming(gateway.url) == {f"gpu1/{MODEL}": 1.0, f"gpu2/{MODEL}": 1.0}
    assert "⚠" not in host_row(gateway)


def burst_turn(gateway, opening: str, *later: str) -> None:
    """One turn of a burst: answered or refused, whichever the gateway chose."""
    body = conversation(opening, *later)
    httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=30)
