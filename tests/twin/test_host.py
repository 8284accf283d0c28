"""The twin's llama-server (bench/twin/host.py) does what llama-server does with its slots,
its host memory and its speeds, in virtual time."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from twin.clock import Deadlocked, in_virtual_time
from twin.host import Cut, Job, Refused, TwinHost
from twin.shapes import HostProfile, ModelProfile, Segment
from twin.workloads import WORKLOADS, Scale

MODEL = ModelProfile(
    "chat", size_gb=5.0, load_s=4.0, prefill_tps=1000.0, decode_tps=(50.0, 40.0, 30.0),
    restore_tps=100_000.0, kv_bytes_per_token=1024 * 1024,
)  # fmt: skip
PROFILE = HostProfile("test", slots=2, cache_ram_mib=10_000, memory_gb=48.0, models_max=1,
                      models={"chat": MODEL})  # fmt: skip

SYSTEM = Segment(1, 1000)
A, B = Segment(10, 500), Segment(20, 500)


def answer(number: int, tokens: int = 10) -> Segment:
    return Segment(-number, tokens)


async def served(host: TwinHost, prompt: tuple[Segment, ...], made: Segment,
                 id_slot: int | None = None) -> Job:  # fmt: skip
    job = host.start(prompt, made.tokens, id_slot, made)
    await job.done
    return job


def test_a_conversation_back_on_its_named_slot_finds_its_prompt_and_its_answer_cached() -> None:
    async def main() -> Job:
        host = TwinHost("h", PROFILE, "chat")
        first = answer(1)
        await served(host, (SYSTEM, A), first, id_slot=1)
        return await served(host, (SYSTEM, A, first, Segment(11, 200)), answer(2), id_slot=1)

    second = in_virtual_time(main())
    assert (second.cache_n, second.prompt_n) == (1510, 200)
    assert second.prompt_ms == pytest.approx(200.0)  # 200 tokens at 1,000 a second


def test_unnamed_a_turn_adding_more_than_the_similarity_allows_goes_to_the_lru_slot() -> None:
    """llama-server at --slot-prompt-similarity 0.95: 1,510 of 1,710 tokens is 0.88 of the
    prompt, so the slot holding them does not qualify; the least recently used (empty) one
    does, and host memory holds nothing yet: all of it is evaluated again. Hence crossbar
    names a conversation's slot (`id_slot`)."""

    async def main() -> Job:
        host = TwinHost("h", PROFILE, "chat")
        first = answer(1)
        await served(host, (SYSTEM, A), first)
        return await served(host, (SYSTEM, A, first, Segment(11, 200)), answer(2))

    second = in_virtual_time(main())
    assert (second.cache_n, second.prompt_n) == (0, 1710)


def test_a_prompt_all_cached_still_evaluates_one_token() -> None:
    async def main() -> Job:
        host = TwinHost("h", PROFILE, "chat")
        await served(host, (SYSTEM, A), answer(1))
        return await served(host, (SYSTEM, A), answer(2))

    again = in_virtual_time(main())
    assert (again.cache_n, again.prompt_n) == (1499, 1)


def test_an_idle_slot_holding_most_of_the_prompt_is_chosen_over_the_least_recently_used() -> None:
    async def main() -> tuple[int, int]:
        host = TwinHost("h", PROFILE, "chat")
        one = host.start((SYSTEM, A), 10, None, answer(1))
        two = host.start((Segment(2, 1000), B), 10, None, answer(2))
        await asyncio.gather(one.done, two.done)
        assert one.slot is not None and two.slot is not None
        back = await served(host, (SYSTEM, A, answer(1), Segment(12, 50)), answer(3))
        assert back.slot is not None
        return one.slot.index, back.slot.index

    first, back = in_virtual_time(main())
    assert back == first


def test_a_request_naming_a_busy_slot_waits_for_it_though_another_is_idle() -> None:
    async def main() -> tuple[float, float, int]:
        loop = asyncio.get_running_loop()
        host = TwinHost("h", PROFILE, "chat")
        running = host.start((SYSTEM, A), 100, 0, answer(1))
        named = host.start((SYSTEM, B), 10, 0, answer(2))
        await running.done
        freed = loop.time()
        await named.first_token
        assert named.slot is not None
        return freed, named.arrived, named.slot.index

    freed, arrived, slot = in_virtual_time(main())
    assert slot == 0 and freed > arrived + 1.0  # it waited the other's whole answer


def test_a_slot_moving_on_saves_its_prompt_to_host_memory_and_a_returning_one_restores_it() -> None:
    one_slot = replace(PROFILE, slots=1)

    async def main() -> tuple[Job, TwinHost]:
        host = TwinHost("h", one_slot, "chat")
        first = answer(1)
        await served(host, (SYSTEM, A), first)
        await served(host, (Segment(2, 1000), B), answer(2))  # the slot moves on
        back = await served(host, (SYSTEM, A, first, Segment(12, 50)), answer(3))
        return back, host

    back, host = in_virtual_time(main())
    assert (back.cache_n, back.prompt_n) == (1510, 50)
    assert host.restores == 1
    assert back.restore_s == pytest.approx(1510 / MODEL.restore_tps)


def test_without_host_memory_a_conversation_whose_slot_moved_on_is_evaluated_again() -> None:
    no_memory = replace(PROFILE, slots=1, cache_ram_mib=0)

    async def main() -> Job:
        host = TwinHost("h", no_memory, "chat")
        first = answer(1)
        await served(host, (SYSTEM, A), first)
        await served(host, (Segment(2, 1000), B), answer(2))
        return await served(host, (SYSTEM, A, first, Segment(12, 50)), answer(3))

    back = in_virtual_time(main())
    assert (back.cache_n, back.prompt_n) == (0, 1560)


def test_host_memory_drops_its_oldest_prompts_when_it_is_full() -> None:
    # 3,000 MiB at 1 MiB a token: room for two prompts of 1,510 tokens, not three.
    small = replace(PROFILE, slots=1, cache_ram_mib=3_100)

    async def main() -> list[int]:
        host = TwinHost("h", small, "chat")
        prompts = [(Segment(100 + n, 1000), Segment(200 + n, 500)) for n in range(4)]
        for number, prompt in enumerate(prompts):
            await served(host, prompt, answer(number))
        cached = []
        for number in (2, 0):
            job = await served(host, (*prompts[number], answer(number), Segment(300, 5)),
                               answer(9))  # fmt: skip
            cached.append(job.cache_n)
        return cached

    # Each new prompt saved the one before it; the 3rd's save dropped the 1st (the oldest),
    # and the 3rd comes back from host memory whole.
    assert in_virtual_time(main()) == [1510, 0]


def test_streams_decoding_together_each_go_slower_than_one_alone() -> None:
    async def alone() -> float:
        host = TwinHost("h", PROFILE, "chat")
        job = await served(host, (A,), answer(1, 400))
        return asyncio.get_running_loop().time() - job.arrived

    async def together() -> float:
        host = TwinHost("h", PROFILE, "chat")
        one = host.start((A,), 400, None, answer(1, 400))
        two = host.start((B,), 400, None, answer(2, 400))
        await asyncio.gather(one.done, two.done)
        return asyncio.get_running_loop().time() - one.arrived

    # Alone: 0.5 s of prompt, 400 tokens at 50/s. Together: both prompts, then 40/s each.
    assert in_virtual_time(alone()) == pytest.approx(0.5 + 8.0)
    assert in_virtual_time(together()) == pytest.approx(1.0 + 10.0, rel=0.01)


def test_a_prompt_being_evaluated_holds_back_the_streams_decoding() -> None:
    async def main() -> float:
        host = TwinHost("h", PROFILE, "chat")
        decoding = host.start((A,), 100, None, answer(1, 100))
        await decoding.first_token  # 0.5 s
        long_prompt = host.start((Segment(3, 8000),), 1, None, answer(2, 1))
        await long_prompt.first_token  # 8 s, while the other gets 1,000/2,048 tokens a second
        return decoding.decode_left

    # It had 100 tokens to go; 8 s of prompt let it make about 4.
    assert in_virtual_time(main()) == pytest.approx(100 - 8 * 1000 / 2048, abs=0.5)


def test_a_restart_cuts_what_runs_loses_the_caches_and_refuses_until_the_host_is_up() -> None:
    async def main() -> tuple[Job, Job]:
        host = TwinHost("h", PROFILE, "chat")
        first = answer(1)
        await served(host, (SYSTEM, A), first)
        running = host.start((SYSTEM, B), 500, None, answer(2, 500))
        await running.first_token
        host.go_down()
        with pytest.raises(Cut):
            await running.done
        with pytest.raises(Refused):
            host.start((SYSTEM, A, first), 10, None, answer(3))
        host.come_up()
        back = await served(host, (SYSTEM, A, first, Segment(12, 50)), answer(4))
        return running, back

    _, back = in_virtual_time(main())
    assert back.cache_n == 0  # its slot and host memory went with the restart


def test_a_twin_whose_tasks_all_wait_on_nothing_says_it_deadlocked() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nobody will set it

    with pytest.raises(Deadlocked):
        in_virtual_time(main())


def test_virtual_time_moves_to_each_timer_as_it_falls_due() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = []
        for delay in (3600.0, 0.25, 10.0):
            await asyncio.sleep(delay)
            seen.append(loop.time())
        return seen

    assert in_virtual_time(main()) == [3600.0, 3600.25, 3610.25]


def test_an_idle_slots_prompt_is_saved_to_host_memory_when_another_request_launches() -> None:
    """llama-server's --cache-idle-slots (on by default). A conversation whose next turn adds
    more than 5% leaves its own slot (at similarity 0.95) for the least recently used one;
    its history is still in its own slot, never overwritten, yet it comes back from host
    memory, saved there when another request launched while its slot was idle."""
    three = replace(PROFILE, slots=3)

    async def main() -> Job:
        host = TwinHost("h", three, "chat")
        first = answer(1, 400)
        short = host.start((Segment(2, 1000), B), 10, None, answer(2, 10))  # slot 2
        mine = host.start((SYSTEM, A), 400, None, first)  # slot 1, ends last
        other = host.start((Segment(3, 1000), Segment(31, 500)), 100, None, answer(3, 100))
        await asyncio.gather(short.done, mine.done, other.done)
        host.start((Segment(4, 800),), 1000, None, answer(5, 1000))  # takes slot 2
        return await served(host, (SYSTEM, A, first, Segment(12, 200)), answer(4))

    back = in_virtual_time(main())
    assert back.slot is not None and back.slot.index == 0  # not its own slot
    assert (back.cache_n, back.prompt_n) == (1900, 200)


def test_a_slot_taken_by_similarity_that_keeps_over_half_is_not_saved_nor_swapped() -> None:
    """At similarity 0.1 a prompt sharing a slot's opening takes that slot; keeping more than
    half of what the slot holds, llama-server neither saves it nor looks in host memory, even
    though host memory holds the prompt's own history."""
    low = replace(PROFILE, similarity=0.1)

    async def main() -> Job:
        host = TwinHost("h", low, "chat")
        mine = answer(1)
        await served(host, (SYSTEM, B), mine)  # slot 1
        unrelated = host.start((Segment(7, 300),), 2000, None, answer(2, 2000))  # slot 0
        await unrelated.first_token  # launched while slot 1 was idle: saved to host memory
        await served(host, (SYSTEM, A), answer(3))  # slot 1 again (its opening), unsaved
        await unrelated.done
        return await served(host, (SYSTEM, B, mine, Segment(12, 50)), answer(4))

    back = in_virtual_time(main())
    assert back.slot is not None and back.slot.index == 1
    assert (back.cache_n, back.restore_s) == (1000, 0.0)  # the opening, not its own history


def test_host_memory_restores_no_entry_that_would_keep_under_a_quarter_of_itself() -> None:
    one_slot = replace(PROFILE, slots=1)

    async def main() -> Job:
        host = TwinHost("h", one_slot, "chat")
        await served(host, (SYSTEM, Segment(5, 5000)), answer(1))
        await served(host, (Segment(7, 100),), answer(2))  # saves the first to host memory
        return await served(host, (SYSTEM, Segment(8, 200)), answer(3))

    # The first shares its 1,000-token opening: 1,000 of its 6,010 tokens, under a quarter.
    assert in_virtual_time(main()).cache_n == 0


def test_an_opening_takes_a_saved_prompt_sharing_one_token_more_whose_next_turn_is_lost() -> None:
    """bench-cache's tasks 1 and 10 share `Task 1` beyond the system message that every task
    shares. On one slot, task 10's opening finds the slot holding task 3's history (the system
    message) and host memory holding task 1's (one token more): llama-server restores that,
    taking it out of host memory, so task 1's next turn finds the system message and a digit
    only and is evaluated again."""
    one_slot = replace(PROFILE, slots=1)
    bench = {c.id: c for c in WORKLOADS["calibration"](0, Scale(2, 2, 1)).conversations()}
    task_1, task_3, task_10 = bench[1], bench[3], bench[10]

    async def main() -> tuple[Job, Job]:
        host = TwinHost("h", one_slot, "chat")
        first = answer(1, 96)
        await served(host, task_1.opening, first)
        await served(host, task_3.opening, answer(3, 96))  # task 1's history to host memory
        opening = await served(host, task_10.opening, answer(10, 96))
        again = (*task_1.opening, *task_1.turns[1].added)
        return opening, await served(host, again, answer(2, 96))

    opening, again = in_virtual_time(main())
    system = task_1.opening[0].tokens
    assert opening.restore_s > 0 and opening.cache_n == system + 1
    assert (again.cache_n, again.prompt_n) == (system + 1, again.tokens - system - 1)
