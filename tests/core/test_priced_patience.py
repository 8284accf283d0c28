"""Placement with `lease_patience` auto: a busy home's request stays in line or takes a free
slot elsewhere, whichever its prices say is sooner (routing/core/patience.py), over the
in-memory fleet of tests/core/test_placement.py.

The figures are set by hand: gpu1 (home) evaluates prompts at 1,000 tokens a second and holds
the conversation's whole prompt; gpu2 and gpu3 hold none of it, so their cold start is the
whole prompt at their speed.
"""

from __future__ import annotations

import asyncio

import pytest

from routing.core.leases import LeaseKey, LeaseOutcome
from routing.core.limiter import Slot, Waiter
from routing.core.pairs import Pair
from routing.core.patience import Choice, Figures, Pricing
from routing.core.placement import Placement, Placer, Reason, Waiting
from routing.core.prefixes import NO_PREFIX, PrefixIndex, prefix_blocks
from tests.helpers.memory_fleet import (
    EARLY,
    LONG,
    MODEL,
    SHORT,
    WAIT,
    MemoryFleet,
    Route,
    assert_nothing_held,
    host,
    lease_of,
    settle,
)

AUTO = Route(lease_patience=None)
# 40 whole blocks and 8 characters more; at 4 characters a token, 2,562 tokens.
PROMPT = prefix_blocks({"messages": [{"role": "user", "content": "word " * 2048 + "abc"}]})
TOKENS = PROMPT.length // 4


class Prices:
    """Figures and a prefix index for the conversation's prompt, set by hand."""

    def __init__(self, fleet: MemoryFleet, home_service: float = 1.0) -> None:
        self.fleet = fleet
        self.figures = Figures()
        self.index = PrefixIndex(10_000)
        self.index.learn("gpu1", MODEL, PROMPT.blocks)
        self.figures.prompted("gpu1", MODEL, PROMPT, TOKENS, TOKENS - 1, 1.0)  # 4 chars a token
        self.speed("gpu1", 1000.0)
        self.served("gpu1", home_service)

    def speed(self, name: str, tokens_per_second: float) -> None:
        self.figures.prompted(name, MODEL, NO_PREFIX, 1000, 0, 1e6 / tokens_per_second)

    def cold_start(self, name: str, seconds: float) -> None:
        """Make `name`'s cold start of the prompt take `seconds`."""
        self.speed(name, TOKENS / seconds)

    def served(self, name: str, seconds: float) -> None:
        self.figures.held(name, MODEL, seconds)

    def placer(self, route: Route = AUTO, default: float = LONG) -> Placer:
        slots = lambda name: self.fleet.hosts[name]["models"][MODEL]["parallel"]  # noqa: E731
        pricing = Pricing(self.figures, self.index, MODEL, PROMPT, slots, default)
        return Placer(self.fleet, route, MODEL, "conversation", asyncio.get_running_loop().time(),
                      pricing=pricing)  # fmt: skip


def at_home(fleet: MemoryFleet, route: Route = AUTO) -> None:
    """The conversation's lease is on gpu1."""
    fleet.leases.keep(LeaseKey(route.name, "conversation", MODEL), "gpu1", route.lease_ttl)


def home_busy() -> tuple[MemoryFleet, Slot]:
    """gpu1 and gpu2, a slot and a line of 2 each; the conversation leased to gpu1, whose slot
    another request holds (returned, to release)."""
    fleet = MemoryFleet({"gpu1": host(queue_max=2), "gpu2": host(queue_max=2)}, AUTO)
    at_home(fleet)
    return fleet, fleet.occupy("gpu1")


async def waiting_at_home(
    prices: Prices, route: Route = AUTO, default: float = LONG
) -> tuple[Placer, Waiting]:
    request = prices.placer(route, default)
    waiting = await request.now()
    assert isinstance(waiting, Waiting)
    assert (waiting.host, waiting.reason) == ("gpu1", Reason.HOME)
    return request, waiting


async def waiting_at_home_in_a_task(prices: Prices) -> asyncio.Task[Placement]:
    """The conversation's request, waiting in its home's line (as `waiting_at_home`)."""
    request, waiting = await waiting_at_home(prices)
    return asyncio.create_task(request.wait(waiting))


async def test_home_wait_longer_than_cold_start_spills_at_once() -> None:
    fleet, running = home_busy()
    prices = Prices(fleet, home_service=10.0)
    prices.cold_start("gpu2", 1.0)
    request, waiting = await waiting_at_home(prices)  # no default patience to run out

    got = await asyncio.wait_for(request.wait(waiting), WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.SPILLED, LeaseOutcome.SPILLED)
    assert got.patience is not None
    assert got.patience.choice is Choice.SPILL
    # First in line behind a 10 s request; then home evaluates the prompt's last 2 tokens.
    assert got.patience.stay == pytest.approx(10.0, abs=0.01)
    assert got.patience.spill == pytest.approx(1.0)
    assert lease_of(fleet, AUTO) == "gpu1"  # the lease stays with the cache-warm host
    assert fleet.limiter.queued("gpu1", MODEL) == 0
    # Its wait at home is never known: the line's prices are not corrected by it.
    assert prices.figures.lateness("gpu1", MODEL) == 1.0
    assert prices.figures.lateness("gpu2", MODEL) == 1.0  # nor gpu2's: it never waited there
    running.release()
    got.slot.release()
    assert_nothing_held(fleet)


async def test_cold_start_longer_than_home_wait_stays_in_line() -> None:
    fleet, running = home_busy()
    prices = Prices(fleet, home_service=1.0)
    prices.cold_start("gpu2", 5.0)
    task = await waiting_at_home_in_a_task(prices)
    await settle()
    assert not task.done()
    assert fleet.limiter.free_for("gpu2", MODEL) == 1  # priced, and left free

    running.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu1", Reason.HOME, LeaseOutcome.REUSED)
    assert got.patience is not None
    assert got.patience.choice is Choice.STAY
    assert got.patience.stay == pytest.approx(1.0, abs=0.01)
    assert got.patience.spill == pytest.approx(5.0)
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_wait_at_home_longer_than_priced_makes_the_next_one_priced_longer() -> None:
    fleet, running = home_busy()
    prices = Prices(fleet, home_service=0.1)
    prices.cold_start("gpu2", 5.0)
    task = await waiting_at_home_in_a_task(prices)
    await asyncio.sleep(0.25)  # the running request takes longer than home's 0.1 s service
    assert not task.done()

    running.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason) == ("gpu1", Reason.HOME)
    assert got.patience is not None and got.patience.stay == pytest.approx(0.1, abs=0.01)
    lateness = prices.figures.lateness("gpu1", MODEL)
    assert lateness >= 2.5  # waited at least 0.25 s where 0.1 s was priced
    # The next request of the conversation, behind this one, is priced by what the wait took.
    task = await waiting_at_home_in_a_task(prices)
    await settle()
    got.slot.release()
    again = await asyncio.wait_for(task, WAIT)
    assert again.patience is not None
    assert again.patience.stay == pytest.approx(0.1 * lateness, abs=0.01)
    again.slot.release()
    assert_nothing_held(fleet)


async def test_line_moves_re_decided() -> None:
    fleet, running = home_busy()
    prices = Prices(fleet, home_service=1.0)
    prices.cold_start("gpu2", 3.0)
    ahead = fleet.limiter.place([Pair("gpu1", MODEL)])  # another request, first in home's line
    assert isinstance(ahead, Waiter)
    request, waiting = await waiting_at_home(prices)
    assert waiting.waiter.position == 2
    task = asyncio.create_task(request.wait(waiting))
    await settle()
    assert not task.done()  # second in line, 2 s, against a 3 s cold start: it stays
    assert fleet.limiter.free_for("gpu2", MODEL) == 1

    # The running request took 10 s: home's service time goes up, and the line moves.
    prices.served("gpu1", 10.0)
    running.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.SPILLED, LeaseOutcome.SPILLED)
    assert got.patience is not None and got.patience.choice is Choice.SPILL
    service = prices.figures.service("gpu1", MODEL)
    assert service is not None and service > 3.0
    assert got.patience.stay == pytest.approx(service, abs=0.01)  # first in line now
    assert lease_of(fleet, AUTO) == "gpu1"
    (await asyncio.wait_for(ahead.granted, WAIT)).release()
    got.slot.release()
    assert_nothing_held(fleet)


async def waiting_while_gpu2_is_busy(
    home_service: float, cold_start: float
) -> tuple[MemoryFleet, Slot, Slot, asyncio.Task[Placement]]:
    """A request waiting at its busy home, gpu1, while gpu2's one slot is held too: the
    fleet, the slots held on gpu1 and on gpu2 (to release), and the wait."""
    fleet, running = home_busy()
    prices = Prices(fleet, home_service=home_service)
    prices.cold_start("gpu2", cold_start)
    other = fleet.occupy("gpu2")
    task = await waiting_at_home_in_a_task(prices)
    await settle()
    assert not task.done()  # nothing is free elsewhere
    return fleet, running, other, task


async def test_a_slot_freed_elsewhere_is_priced_as_it_frees() -> None:
    fleet, running, other, task = await waiting_while_gpu2_is_busy(10.0, cold_start=1.0)

    other.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason) == ("gpu2", Reason.SPILLED)
    assert got.patience is not None and got.patience.choice is Choice.SPILL
    running.release()
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_slot_freed_elsewhere_and_turned_down_is_the_choice_a_stay_records() -> None:
    fleet, running, other, task = await waiting_while_gpu2_is_busy(1.0, cold_start=5.0)

    other.release()  # priced as it frees: 5 s cold against a 1 s wait, turned down
    await settle()
    assert not task.done()
    assert fleet.limiter.free_for("gpu2", MODEL) == 1

    running.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason) == ("gpu1", Reason.HOME)
    assert got.patience is not None and got.patience.choice is Choice.STAY
    assert got.patience.stay == pytest.approx(1.0, abs=0.01)
    assert got.patience.spill == pytest.approx(5.0)  # not None: a free slot was priced
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_spill_takes_the_free_host_with_the_soonest_cold_start() -> None:
    route = Route(hosts=("gpu1", "gpu2", "gpu3"), lease_patience=None)
    fleet = MemoryFleet({name: host(queue_max=2) for name in route.hosts}, route)
    prices = Prices(fleet, home_service=10.0)
    prices.cold_start("gpu2", 4.0)  # first in the ranking's order, but slower
    prices.cold_start("gpu3", 2.0)
    at_home(fleet, route)
    running = fleet.occupy("gpu1")
    request, waiting = await waiting_at_home(prices, route=route)

    got = await asyncio.wait_for(request.wait(waiting), WAIT)

    assert (got.host, got.reason) == ("gpu3", Reason.SPILLED)
    assert got.patience is not None and got.patience.spill == pytest.approx(2.0)
    running.release()
    got.slot.release()
    assert_nothing_held(fleet)


async def test_no_measurements_fixed_default() -> None:
    fleet, running = home_busy()
    prices = Prices(fleet)
    prices.figures = Figures()  # nothing measured yet
    other = fleet.occupy("gpu2")
    request, waiting = await waiting_at_home(prices, default=SHORT)
    task = asyncio.create_task(request.wait(waiting))
    loop = asyncio.get_running_loop()
    await asyncio.sleep(request.started + SHORT + SHORT / 5 - loop.time())  # past the default
    await settle()
    assert not task.done()

    other.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.SPILLED, LeaseOutcome.SPILLED)
    assert got.waited >= SHORT - EARLY
    assert got.patience is not None
    assert (got.patience.choice, got.patience.stay, got.patience.spill) == (
        Choice.DEFAULT, None, None,
    )  # fmt: skip
    running.release()
    got.slot.release()
    assert_nothing_held(fleet)


async def test_no_measurements_a_free_host_waits_for_the_default_first() -> None:
    fleet, running = home_busy()
    prices = Prices(fleet)
    prices.figures = Figures()
    request, waiting = await waiting_at_home(prices, default=SHORT)
    task = asyncio.create_task(request.wait(waiting))
    await settle()
    assert not task.done()  # gpu2 is free, but the default has not passed

    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason) == ("gpu2", Reason.SPILLED)
    assert got.waited >= SHORT - EARLY
    running.release()
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_request_of_an_auto_route_without_prices_waits_the_fixed_default() -> None:
    fleet, running = home_busy()
    request = Placer(fleet, AUTO, MODEL, "conversation", asyncio.get_running_loop().time())
    waiting = await request.now()
    assert isinstance(waiting, Waiting) and waiting.host == "gpu1"  # auto is patient
    task = asyncio.create_task(request.wait(waiting))
    await settle()

    assert not task.done()  # gpu2 is free: 2 s of default patience first
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    running.release()
    assert_nothing_held(fleet)


async def test_a_cancelled_priced_wait_leaves_its_line_and_every_watch() -> None:
    fleet, running = home_busy()
    prices = Prices(fleet, home_service=1.0)
    prices.cold_start("gpu2", 5.0)
    task = await waiting_at_home_in_a_task(prices)
    await settle()

    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

    assert fleet.limiter.queued("gpu1", MODEL) == 0
    running.release()
    assert_nothing_held(fleet)


async def test_a_wait_at_once_or_a_fixed_patience_records_no_choice() -> None:
    fleet = MemoryFleet({"gpu1": host(queue_max=2), "gpu2": host(queue_max=2)}, AUTO)
    prices = Prices(fleet)
    at_home(fleet)
    home = await prices.placer().now()
    assert isinstance(home, Placement) and home.patience is None  # a free slot at home
    fixed = Route(lease_patience=SHORT)
    at_home(fleet, fixed)
    request, waiting = await waiting_at_home(prices, route=fixed)

    got = await asyncio.wait_for(request.wait(waiting), WAIT)

    assert (got.host, got.reason, got.patience) == ("gpu2", Reason.SPILLED, None)
    home.slot.release()
    got.slot.release()
    assert_nothing_held(fleet)
