"""The table of requests running now: added, placed, counted, finished, read."""

from __future__ import annotations

import threading

from routing.core.running import RunningTable, data_events


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_request_shows_from_its_start_until_it_finishes() -> None:
    table = RunningTable()

    entry = table.add("chat", "llama3", "team-a")
    during = table.snapshot()
    table.finish(entry)

    assert [(row.route, row.model, row.client) for row in during] == [("chat", "llama3", "team-a")]
    assert table.snapshot() == []


def test_a_waiting_request_has_no_host_and_no_queue_time_until_it_is_placed() -> None:
    clock = Clock()
    table = RunningTable(clock)
    entry = table.add("chat", "llama3", "")

    clock.now += 1.5
    [waiting] = table.snapshot()
    table.placed(entry, "gpu1", 1500, "llama3")
    clock.now += 2.0
    [running] = table.snapshot()

    assert (waiting.host, waiting.queued_ms, waiting.elapsed_ms) == ("", None, 1500)
    assert (running.host, running.queued_ms, running.elapsed_ms) == ("gpu1", 1500, 3500)


class Line:
    """A place in a host's queue, moving up as the line moves."""

    def __init__(self, host: str, position: int) -> None:
        self.host = host
        self.position = position


def test_a_queued_request_shows_whose_line_it_is_in_and_its_place_until_it_is_placed() -> None:
    table = RunningTable()
    entry = table.add("chat", "llama3", "")
    line = Line("gpu2", 3)

    table.waits(entry, line)
    [third] = table.snapshot()
    line.position = 1
    [first] = table.snapshot()
    table.placed(entry, "gpu2", 800, "llama3")
    [running] = table.snapshot()

    assert (third.host, third.line, third.place) == ("", "gpu2", 3)
    assert (first.line, first.place) == ("gpu2", 1)
    assert (running.host, running.line, running.place) == ("gpu2", "", 0)


def test_the_snapshot_takes_the_oldest_up_to_its_limit() -> None:
    table = RunningTable()
    for i in range(5):
        table.add("chat", f"m{i}", "")

    assert [row.model for row in table.snapshot(2)] == ["m0", "m1"]


def test_finishing_twice_does_nothing_the_second_time() -> None:
    table = RunningTable()
    first = table.add("chat", "m", "")
    second = table.add("chat", "m", "")

    table.finish(first)
    table.finish(first)

    assert [row.number for row in table.snapshot()] == [second.number]
    assert len(table) == 1


def test_the_snapshot_lists_the_oldest_first() -> None:
    table = RunningTable()
    entries = [table.add("chat", f"m{i}", "") for i in range(5)]
    table.finish(entries[2])

    assert [row.model for row in table.snapshot()] == ["m0", "m1", "m3", "m4"]


def test_requests_finished_from_other_threads_all_leave_the_table() -> None:
    table = RunningTable()
    entries = [table.add("chat", "m", "") for _ in range(2000)]

    def finish(part: list) -> None:
        for entry in part:
            table.finish(entry)
            table.snapshot()

    threads = [threading.Thread(target=finish, args=(entries[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert table.snapshot() == [] and len(table) == 0


def test_data_events_counts_each_sse_event_once_and_not_the_end_marker() -> None:
    stream = (
        b'data: {"choices":[{"delta":{"content":"data: hi"}}]}\n\n'
        b'data: {"choices":[{"delta":{"content":"!"}}]}\n\n'
        b": crossbar-status: running\n\n"
        b"data: [DONE]\n\n"
    )

    assert data_events(stream) == 2
    assert data_events(b"") == 0
    assert data_events(b"data: [DONE]\n\n") == 0
    # An event per chunk, as llama-server sends them.
    assert sum(data_events(part + b"\n\n") for part in stream.split(b"\n\n") if part) == 2


def test_the_requests_holding_a_hosts_slots_say_how_long_they_have_held_them() -> None:
    clock = Clock()
    table = RunningTable(clock)
    first, second, other = (table.add("chat", "llama3", "") for _ in range(3))

    table.placed(first, "gpu1", 0, "llama3")
    clock.now += 2.0
    table.placed(second, "gpu1", 0, "llama3")
    table.placed(other, "gpu1", 0, "mistral")
    clock.now += 1.0

    assert sorted(table.holding("gpu1", "llama3")) == [1.0, 3.0]
    assert table.holding("gpu1", "mistral") == [1.0]
    assert table.holding("gpu2", "llama3") == []
    table.finish(first)
    assert table.holding("gpu1", "llama3") == [1.0]
    table.freed(second)  # its slot given back while the client still reads its answer
    assert table.holding("gpu1", "llama3") == []
    assert [row.host for row in table.snapshot()] == ["gpu1", "gpu1"]  # shown till it ends


def test_a_request_asked_again_elsewhere_holds_only_its_new_slot() -> None:
    clock = Clock()
    table = RunningTable(clock)
    entry = table.add("chat", "llama3", "")

    table.placed(entry, "gpu1", 0, "llama3")
    clock.now += 1.0
    table.placed(entry, "gpu2", 0, "llama3")  # gpu1 failed before answering
    clock.now += 0.5

    assert table.holding("gpu1", "llama3") == []
    assert table.holding("gpu2", "llama3") == [0.5]
    table.finish(entry)
    table.finish(entry)  # again: nothing
    assert table.holding("gpu2", "llama3") == []
