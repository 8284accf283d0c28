from __future__ import annotations

from collections.abc import Callable

import pytest

from routing.core.leases import LeaseKey, LeaseOutcome, LeaseTable, NoHealthyHost, PinnedHostDown

KEY = LeaseKey(route="chat", fingerprint="f" * 64, model="qwen")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def always(host: str) -> bool:
    return True


def picks(*hosts: str | None) -> Callable[[], str | None]:
    """A chooser returning the given hosts in turn, and failing the test if asked again."""
    remaining = list(hosts)

    def choose() -> str | None:
        assert remaining, "choose() called more often than expected"
        return remaining.pop(0)

    return choose


async def lease(
    table: LeaseTable,
    key: LeaseKey = KEY,
    *,
    choose: Callable[[], str | None],
    usable: Callable[[str], bool] = always,
    ttl: float = 60.0,
    strict: bool = False,
) -> tuple[str, LeaseOutcome]:
    return await table.lease(key, ttl=ttl, strict=strict, usable=usable, choose=choose)


async def test_first_request_of_a_conversation_gets_a_new_lease() -> None:
    table = LeaseTable()

    assert await lease(table, choose=picks("h1")) == ("h1", LeaseOutcome.NEW)
    assert table.host_of(KEY) == "h1"
    assert len(table) == 1


async def test_next_turn_reuses_the_lease_without_choosing() -> None:
    table = LeaseTable()
    await lease(table, choose=picks("h1"))

    assert await lease(table, choose=picks()) == ("h1", LeaseOutcome.REUSED)


async def test_lease_on_an_unusable_host_moves_to_a_newly_chosen_one() -> None:
    table = LeaseTable()
    await lease(table, choose=picks("h1"))

    moved = await lease(table, choose=picks("h2"), usable=lambda host: host != "h1")

    assert moved == ("h2", LeaseOutcome.MOVED)
    assert table.host_of(KEY) == "h2"
    assert await lease(table, choose=picks()) == ("h2", LeaseOutcome.REUSED)


async def test_strict_route_refuses_when_the_pinned_host_is_unusable() -> None:
    table = LeaseTable()
    await lease(table, choose=picks("h1"))

    with pytest.raises(PinnedHostDown) as refused:
        await lease(table, choose=picks(), usable=lambda host: False, strict=True)

    assert refused.value.host == "h1"
    # The pin survives: once the host is back, the conversation returns to it.
    assert await lease(table, choose=picks(), strict=True) == ("h1", LeaseOutcome.REUSED)


async def test_no_healthy_host_stores_nothing() -> None:
    table = LeaseTable()

    with pytest.raises(NoHealthyHost):
        await lease(table, choose=picks(None))

    assert len(table) == 0
    assert table.host_of(KEY) is None


async def test_no_healthy_host_while_moving_keeps_the_old_lease() -> None:
    table = LeaseTable()
    await lease(table, choose=picks("h1"))

    with pytest.raises(NoHealthyHost):
        await lease(table, choose=picks(None), usable=lambda host: False)

    assert table.host_of(KEY) == "h1"


async def test_request_without_fingerprint_is_chosen_each_time_and_never_stored() -> None:
    table = LeaseTable()
    anonymous = LeaseKey(route="chat", fingerprint="", model="qwen")

    assert await lease(table, anonymous, choose=picks("h1")) == ("h1", LeaseOutcome.NONE)
    assert await lease(table, anonymous, choose=picks("h2")) == ("h2", LeaseOutcome.NONE)
    with pytest.raises(NoHealthyHost):
        await lease(table, anonymous, choose=picks(None))
    assert len(table) == 0


def test_lease_outcomes_are_the_header_values() -> None:
    assert [str(outcome) for outcome in LeaseOutcome] == ["new", "reused", "moved", ""]


async def test_lease_expires_after_its_ttl_without_use() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    await lease(table, choose=picks("h1"), ttl=60)

    clock.now += 60
    assert table.host_of(KEY) is None
    assert table.held_by_host() == {}
    assert await lease(table, choose=picks("h2"), ttl=60) == ("h2", LeaseOutcome.NEW)


async def test_each_reuse_slides_the_ttl_forward() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    await lease(table, choose=picks("h1"), ttl=60)

    for _ in range(5):
        clock.now += 50
        assert await lease(table, choose=picks(), ttl=60) == ("h1", LeaseOutcome.REUSED)

    clock.now += 59
    assert table.host_of(KEY) == "h1"
    clock.now += 1
    assert table.host_of(KEY) is None


async def test_looking_up_the_host_does_not_refresh_the_lease() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    await lease(table, choose=picks("h1"), ttl=60)

    clock.now += 50
    assert table.host_of(KEY) == "h1"
    clock.now += 10
    assert table.host_of(KEY) is None


async def test_table_evicts_the_least_recently_used_lease_when_full() -> None:
    table = LeaseTable(max_entries=3)
    keys = [LeaseKey("chat", f"conversation-{number}", "qwen") for number in range(4)]
    for number, key in enumerate(keys[:3]):
        await lease(table, key, choose=picks(f"h{number}"))
    # Using the oldest makes the second the least recently used.
    await lease(table, keys[0], choose=picks())

    await lease(table, keys[3], choose=picks("h3"))

    assert len(table) == 3
    assert table.host_of(keys[1]) is None
    assert [table.host_of(key) for key in (keys[0], keys[2], keys[3])] == ["h0", "h2", "h3"]


async def test_moved_lease_counts_as_recently_used() -> None:
    table = LeaseTable(max_entries=2)
    first = LeaseKey("chat", "first", "qwen")
    second = LeaseKey("chat", "second", "qwen")
    await lease(table, first, choose=picks("h1"))
    await lease(table, second, choose=picks("h1"))

    await lease(table, first, choose=picks("h2"), usable=lambda host: host != "h1")
    await lease(table, LeaseKey("chat", "third", "qwen"), choose=picks("h3"))

    assert table.host_of(first) == "h2"
    assert table.host_of(second) is None


async def test_same_fingerprint_on_another_route_or_model_is_another_lease() -> None:
    table = LeaseTable()
    await lease(table, choose=picks("h1"))

    other_route = LeaseKey("code", KEY.fingerprint, KEY.model)
    other_model = LeaseKey(KEY.route, KEY.fingerprint, "llama")
    assert await lease(table, other_route, choose=picks("h2")) == ("h2", LeaseOutcome.NEW)
    assert await lease(table, other_model, choose=picks("h3")) == ("h3", LeaseOutcome.NEW)
    assert len(table) == 3


async def test_drop_host_removes_only_that_hosts_leases() -> None:
    table = LeaseTable()
    for number, host in enumerate(["h1", "h2", "h1", "h3", "h1"]):
        await lease(table, LeaseKey("chat", f"c{number}", "qwen"), choose=picks(host))

    assert table.drop_host("h1") == 3
    assert table.drop_host("h1") == 0
    assert table.held_by_host() == {"h2": 1, "h3": 1}
    assert len(table) == 2


async def test_held_by_host_counts_only_unexpired_leases() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    await lease(table, LeaseKey("chat", "old", "qwen"), choose=picks("h1"), ttl=10)
    await lease(table, LeaseKey("chat", "long", "qwen"), choose=picks("h1"), ttl=100)
    await lease(table, LeaseKey("chat", "other", "qwen"), choose=picks("h2"), ttl=100)

    assert table.held_by_host() == {"h1": 2, "h2": 1}
    clock.now += 10
    assert table.held_by_host() == {"h1": 1, "h2": 1}
