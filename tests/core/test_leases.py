"""The lease table: which host holds a conversation's KV cache, for how long, and how many."""

from __future__ import annotations

from routing.core.leases import LeaseKey, LeaseOutcome, LeaseTable

KEY = LeaseKey(route="chat", fingerprint="f" * 64, model="qwen")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def conversation(number: int) -> LeaseKey:
    return LeaseKey("chat", f"conversation-{number}", "qwen")


def test_an_unknown_conversation_has_no_host() -> None:
    table = LeaseTable()

    assert table.find(KEY) is None
    assert len(table) == 0
    assert table.held("h1") == 0


def test_a_kept_lease_is_found_on_its_host() -> None:
    table = LeaseTable()

    table.keep(KEY, "h1", ttl=60)

    assert table.find(KEY) == "h1"
    assert len(table) == 1
    assert table.held("h1") == 1
    assert table.held_by_host() == {"h1": 1}


def test_keeping_a_lease_on_another_host_moves_it_and_its_count() -> None:
    table = LeaseTable()
    table.keep(KEY, "h1", ttl=60)

    table.keep(KEY, "h2", ttl=60)

    assert table.find(KEY) == "h2"
    assert len(table) == 1
    assert (table.held("h1"), table.held("h2")) == (0, 1)
    assert table.held_by_host() == {"h2": 1}


def test_a_moved_lease_counts_per_model_for_its_new_host_only() -> None:
    table = LeaseTable()
    table.keep(KEY, "h1", ttl=60)
    table.keep(conversation(2), "h1", ttl=60)  # another conversation, of the same model

    table.keep(KEY, "h2", ttl=60)

    assert (table.held("h1"), table.held("h1", "qwen")) == (1, 1)
    assert (table.held("h2"), table.held("h2", "qwen")) == (1, 1)
    assert (table.held("h2", "other"), table.held("h9", "qwen")) == (0, 0)


def test_a_request_without_fingerprint_is_never_stored() -> None:
    table = LeaseTable()
    anonymous = LeaseKey(route="chat", fingerprint="", model="qwen")

    table.keep(anonymous, "h1", ttl=60)

    assert table.find(anonymous) is None
    assert len(table) == 0
    assert table.held("h1") == 0


def test_lease_outcomes_are_the_header_values() -> None:
    assert [str(outcome) for outcome in LeaseOutcome] == ["new", "reused", "moved", "spilled", ""]


def test_lease_expires_after_its_ttl_without_use() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    table.keep(KEY, "h1", ttl=60)

    clock.now += 59.9
    assert table.find(KEY) == "h1"
    clock.now += 0.1

    assert table.find(KEY) is None
    assert table.held_by_host() == {}
    assert table.held("h1") == 0  # found out expired: no longer counted
    assert len(table) == 0


def test_each_keep_slides_the_ttl_forward() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    table.keep(KEY, "h1", ttl=60)

    for _ in range(5):
        clock.now += 50
        assert table.find(KEY) == "h1"
        table.keep(KEY, "h1", ttl=60)

    clock.now += 59
    assert table.find(KEY) == "h1"
    clock.now += 1
    assert table.find(KEY) is None


def test_finding_the_host_does_not_refresh_the_lease() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    table.keep(KEY, "h1", ttl=60)

    clock.now += 50
    assert table.find(KEY) == "h1"
    clock.now += 10

    assert table.find(KEY) is None


def test_an_expired_lease_kept_again_before_it_was_found_out_counts_once() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    table.keep(KEY, "h1", ttl=10)
    clock.now += 20

    table.keep(KEY, "h2", ttl=10)

    assert table.find(KEY) == "h2"
    assert (table.held("h1"), table.held("h2")) == (0, 1)
    assert len(table) == 1


def test_table_evicts_the_least_recently_used_lease_when_full() -> None:
    table = LeaseTable(max_entries=3)
    keys = [conversation(number) for number in range(4)]
    for number, key in enumerate(keys[:3]):
        table.keep(key, f"h{number}", ttl=60)
    # Keeping the oldest again makes the second the least recently used.
    table.keep(keys[0], "h0", ttl=60)

    table.keep(keys[3], "h3", ttl=60)

    assert len(table) == 3
    assert table.find(keys[1]) is None
    assert table.held("h1") == 0
    assert [table.find(key) for key in (keys[0], keys[2], keys[3])] == ["h0", "h2", "h3"]


def test_a_moved_lease_counts_as_recently_used() -> None:
    table = LeaseTable(max_entries=2)
    first, second = conversation(1), conversation(2)
    table.keep(first, "h1", ttl=60)
    table.keep(second, "h1", ttl=60)

    table.keep(first, "h2", ttl=60)
    table.keep(conversation(3), "h3", ttl=60)

    assert table.find(first) == "h2"
    assert table.find(second) is None
    assert table.held_by_host() == {"h2": 1, "h3": 1}


def test_expired_leases_at_the_old_end_are_trimmed_when_a_lease_is_kept() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    table.keep(conversation(1), "h1", ttl=10)
    table.keep(conversation(2), "h1", ttl=10)
    clock.now += 10

    table.keep(conversation(3), "h2", ttl=10)

    assert len(table) == 1
    assert (table.held("h1"), table.held("h2")) == (0, 1)


def test_a_table_sized_below_one_still_holds_one_lease() -> None:
    table = LeaseTable(max_entries=0)

    table.keep(conversation(1), "h1", ttl=60)
    table.keep(conversation(2), "h2", ttl=60)

    assert len(table) == 1
    assert table.find(conversation(2)) == "h2"
    assert table.held_by_host() == {"h2": 1}


def test_same_fingerprint_on_another_route_or_model_is_another_lease() -> None:
    table = LeaseTable()
    table.keep(KEY, "h1", ttl=60)

    other_route = LeaseKey("code", KEY.fingerprint, KEY.model)
    other_model = LeaseKey(KEY.route, KEY.fingerprint, "llama")
    assert table.find(other_route) is None
    assert table.find(other_model) is None
    table.keep(other_route, "h2", ttl=60)
    table.keep(other_model, "h3", ttl=60)

    assert [table.find(key) for key in (KEY, other_route, other_model)] == ["h1", "h2", "h3"]
    assert len(table) == 3


def test_drop_host_removes_only_that_hosts_leases() -> None:
    table = LeaseTable()
    for number, host in enumerate(["h1", "h2", "h1", "h3", "h1"]):
        table.keep(conversation(number), host, ttl=60)

    assert table.drop_host("h1") == 3
    assert table.drop_host("h1") == 0

    assert table.held_by_host() == {"h2": 1, "h3": 1}
    assert (table.held("h1"), table.held("h2"), table.held("h3")) == (0, 1, 1)
    assert len(table) == 2
    assert table.find(conversation(0)) is None
    assert table.find(conversation(1)) == "h2"


def test_held_by_host_counts_only_unexpired_leases() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    table.keep(conversation(1), "h1", ttl=10)
    table.keep(conversation(2), "h1", ttl=100)
    table.keep(conversation(3), "h2", ttl=100)

    assert table.held_by_host() == {"h1": 2, "h2": 1}
    clock.now += 10

    assert table.held_by_host() == {"h1": 1, "h2": 1}
    # `held` is the cheap count: it trims expired leases from the least recently used end.
    assert table.held("h1") == 1
    assert table.held("h1", "qwen") == 1
    assert table.find(conversation(1)) is None


def test_conversations_on_one_host_share_its_slot_numbers_as_evenly_as_they_can() -> None:
    table = LeaseTable()
    for number in range(5):
        table.keep(conversation(number), "h1", ttl=60)

    given = [table.slot_number(conversation(number), "h1", slots=2) for number in range(5)]

    assert given == [0, 1, 0, 1, 0]  # two a number of their own, then the fewest's, the lowest
    table.keep(conversation(0), "h1", ttl=60)  # its next turn
    assert table.slot_number(conversation(0), "h1", slots=2) == 0
    table.keep(conversation(1), "h2", ttl=60)  # moved: number 1 keeps one conversation on h1
    table.keep(conversation(5), "h1", ttl=60)
    assert table.slot_number(conversation(5), "h1", slots=2) == 1


def test_a_conversation_left_to_its_hosts_choice_keeps_no_number_there_until_it_moves() -> None:
    table = LeaseTable()
    table.keep(conversation(0), "h1", ttl=60)
    table.keep(conversation(1), "h1", ttl=60)
    assert table.slot_number(conversation(0), "h1", slots=2) == 0

    table.leave_to_host(conversation(0), "h1")  # served there before its slots were known
    table.keep(conversation(0), "h1", ttl=60)  # its next turn

    assert table.slot_number(conversation(0), "h1", slots=2) is None
    assert table.slot_number(conversation(1), "h1", slots=2) == 0  # number 0 was given back
    table.keep(conversation(0), "h2", ttl=60)  # moved: a host of its own choosing no more
    assert table.slot_number(conversation(0), "h2", slots=2) == 0


def test_a_slot_number_is_kept_per_host_and_model() -> None:
    table = LeaseTable()
    other_model = LeaseKey("chat", "conversation-1", "llama")
    table.keep(conversation(0), "h1", ttl=60)
    table.keep(conversation(1), "h2", ttl=60)
    table.keep(other_model, "h1", ttl=60)

    assert table.slot_number(conversation(0), "h1", slots=2) == 0
    assert table.slot_number(conversation(1), "h2", slots=2) == 0
    assert table.slot_number(other_model, "h1", slots=2) == 0


def test_a_conversation_is_given_no_number_on_a_host_that_is_not_its_leases() -> None:
    table = LeaseTable()
    table.keep(KEY, "h1", ttl=60)

    assert table.slot_number(KEY, "h2", slots=2) is None
    assert table.slot_number(conversation(9), "h1", slots=2) is None  # no lease at all


def test_a_lease_that_expires_or_moves_gives_its_number_to_the_next_conversation() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    table.keep(conversation(0), "h1", ttl=10)
    table.keep(conversation(1), "h1", ttl=100)
    assert table.slot_number(conversation(0), "h1", slots=2) == 0
    assert table.slot_number(conversation(1), "h1", slots=2) == 1

    clock.now += 20  # conversation 0 expired
    assert table.slot_number(conversation(1), "h1", slots=2) == 1  # 0 is free, 1 keeps its own
    table.keep(conversation(2), "h1", ttl=100)
    assert table.slot_number(conversation(2), "h1", slots=2) == 0

    table.keep(conversation(1), "h2", ttl=100)  # moved: its number on h1 is free again
    table.keep(conversation(3), "h1", ttl=100)
    assert table.slot_number(conversation(3), "h1", slots=2) == 1
    assert table.slot_number(conversation(1), "h2", slots=2) == 0


def test_a_dropped_host_frees_its_numbers() -> None:
    table = LeaseTable()
    table.keep(conversation(0), "h1", ttl=60)
    assert table.slot_number(conversation(0), "h1", slots=1) == 0

    table.drop_host("h1")
    table.keep(conversation(1), "h1", ttl=60)

    assert table.slot_number(conversation(1), "h1", slots=1) == 0


def test_a_number_beyond_fewer_slots_is_given_up_for_one_within_them() -> None:
    table = LeaseTable()
    for number in range(3):
        table.keep(conversation(number), "h1", ttl=60)
        assert table.slot_number(conversation(number), "h1", slots=3) == number

    # The host now has two slots: 2 is beyond them, and its conversation shares the lowest.
    assert table.slot_number(conversation(2), "h1", slots=2) == 0
    assert table.slot_number(conversation(0), "h1", slots=2) == 0
    assert table.slot_number(conversation(1), "h1", slots=2) == 1
    table.keep(conversation(3), "h1", ttl=60)
    assert table.slot_number(conversation(3), "h1", slots=2) == 1  # 0 has two, 1 one
