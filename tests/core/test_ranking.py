"""A kept ranking: the chooser's order (`choose.ranked` from scratch) after any sequence of
changes, each touched as the runtime touches it."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.core.choose import Candidate, ranked
from routing.core.ranking import Rankings

HOSTS = ("a", "b", "c", "d", "e")


def candidate(host: str, **facts: object) -> Candidate:
    base = Candidate(host=host, healthy=True, draining=False, loaded=True, can_serve=True,
                     free=1, queued=0, weight=1.0)  # fmt: skip
    return replace(base, **facts)  # type: ignore[arg-type]


class Facts:
    """Each host's candidate, changed by the test; `None` for a host out of the fleet."""

    def __init__(self) -> None:
        self.now: dict[str, Candidate | None] = {host: candidate(host) for host in HOSTS}

    def __call__(self, host: str, model: str | None) -> Candidate | None:
        return self.now.get(host)

    def from_scratch(self, hosts: tuple[str, ...]) -> list[str]:
        return ranked([c for host in hosts if (c := self.now.get(host)) is not None])


changes = st.fixed_dictionaries(
    {},
    optional={
        "healthy": st.booleans(),
        "draining": st.booleans(),
        "loaded": st.booleans(),
        "can_serve": st.booleans(),
        "free": st.integers(0, 3),
        "queued": st.integers(0, 3),
        "weight": st.sampled_from([0.5, 1.0, 2.0]),
        "leases": st.integers(0, 3),
        "evicts_busy": st.booleans(),
    },
)


@settings(max_examples=200, deadline=None)
@given(
    route=st.permutations(HOSTS).map(lambda hosts: tuple(hosts[:4])),
    steps=st.lists(
        st.tuples(st.sampled_from(HOSTS), changes | st.none(), st.booleans()), max_size=30
    ),
)
def test_a_kept_ranking_is_always_the_order_ranked_gives_from_scratch(route, steps):
    facts = Facts()
    rankings = Rankings(facts)
    ranking = rankings.of("chat", route, "m")
    for host, change, read in steps:
        # A change (None: the host leaves the fleet, as a disabled host does) and its touch.
        facts.now[host] = None if change is None else candidate(host, **change)
        rankings.touch(host)
        if read:  # several changes between reads are applied together
            assert list(ranking.hosts()) == facts.from_scratch(route)
    assert list(ranking.hosts()) == facts.from_scratch(route)
    assert [host for host, _ in ranking.pairs()] == list(ranking.hosts())


def test_a_host_in_two_routes_is_moved_in_both_by_one_touch():
    facts = Facts()
    rankings = Rankings(facts)
    chat = rankings.of("chat", ("a", "b"), "m")
    code = rankings.of("code", ("b", "c"), "m")
    assert chat.hosts() == ["a", "b"] and code.hosts() == ["b", "c"]

    facts.now["b"] = candidate("b", free=3)
    rankings.touch("b")

    assert chat.hosts() == ["b", "a"]
    assert code.hosts() == ["b", "c"]
    facts.now["b"] = candidate("b", free=0)
    rankings.touch("b")
    assert code.hosts() == ["c", "b"]


def test_hosts_listing_the_model_are_known_whether_usable_or_not():
    facts = Facts()
    facts.now["b"] = candidate("b", healthy=False)
    facts.now["c"] = candidate("c", can_serve=False, loaded=False)
    facts.now["d"] = None

    ranking = Rankings(facts).of("chat", ("a", "b", "c", "d"), "m")

    assert ranking.listed == ("a", "b")
    assert ranking.lists("b") and not ranking.lists("c") and not ranking.lists("d")
    assert ranking.hosts() == ["a"]
    assert ranking.pairs() == [("a", "m")]


def test_after_clear_a_ranking_is_built_again_from_the_facts():
    facts = Facts()
    rankings = Rankings(facts)
    before = rankings.of("chat", ("a", "b"), "m")
    facts.now["a"] = candidate("a", draining=True)  # a reload: configuration, not touched

    rankings.clear()
    after = rankings.of("chat", ("a", "b"), "m")

    assert after is not before
    assert after.hosts() == ["b"]
