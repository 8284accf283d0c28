"""A model of the request path, checked against the code.

Hypothesis drives the real `Lifecycle` and `Placer` over a real `Limiter` and `LeaseTable`
(`MemoryFleet`) through random sequences of what happens in production: requests arrive (new
conversations, returning ones, none), hosts reset before their head, hang, go down, come back,
drain; clients leave while queued, while waiting for the head, and mid-stream; hung hosts
answer; `parallel` and `queue_max` are changed; time passes, so patience, `fallback_after`
and `queue_timeout` fire. The one stand-in is how a host is asked (the lifecycle's `forward`): a
fake that answers as each host's mode says, and marks a resetting host down as the real one
does. Time is virtual (the loop's clock moves only when a step says so), so a run is the same
on a busy machine.

After every step it checks what the gateway promises:
- every held slot belongs to a live request (the limiter's in-flight count of each pair is
  exactly the requests holding a slot there: asking the host, or streaming);
- a pair never gets a new slot while it is at `parallel` (after a lower `parallel` it may stay
  above it until requests end, never grow);
- a request is refused (`queue_full`, `no_healthy_host`) only when every usable host of its
  route is full, or none is usable and the route has no fallback to wait for;
- a host's line is served in arrival order;
and at the end, once every request has ended, that nothing is held and every slot can be taken.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from tests.helpers.memory_fleet import MODEL
from tests.helpers.request_path import RequestPath

RequestPath.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_request_path_keeps_every_promise = RequestPath.TestCase


def test_a_request_whose_hosts_all_reset_waits_and_leaves_no_slot_behind() -> None:
    """The sequence the model found once by chance, kept as a plain test: both hosts reset
    before their head, the route has a fallback, so the request waits; a host coming back
    serves it, and no slot is left held by anyone."""
    model = RequestPath()
    model.build(strict=False, patience=2, fallback=True, limits=[(1, 0), (1, 0)],
                modes=["reset", "reset"])  # fmt: skip
    model.arrive("a", 0)
    model.host_behaves("gpu1", "ok")
    model.host_health_changes("gpu1", True)

    model.every_held_slot_belongs_to_a_live_request()
    (request,) = model.requests
    assert request.answered is not None and request.holding == ("gpu1", MODEL)
    model.teardown()
