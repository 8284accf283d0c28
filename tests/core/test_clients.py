"""Client keys at the door (`routing.core.clients.ClientGate`): what a refused client is told,
and the edges of its limits. The gate's main rules are tested in tests/proxy/test_client_keys.py."""

from __future__ import annotations

import pytest

from routing.core.clients import ClientGate, ClientSpec
from routing.core.errors import ClientLimited, InvalidKey, MissingKey, RouteNotAllowed, answer_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_refusal_tells_the_client_why() -> None:
    gate = ClientGate(clock=Clock())
    ci = ClientSpec("ci", routes=frozenset({"chat"}), max_concurrent=1)
    gate.configure({"hash-of-ci": ci})

    with pytest.raises(MissingKey) as missing:
        gate.identify(None)
    with pytest.raises(InvalidKey) as invalid:
        gate.identify("hash-of-another-key")
    with pytest.raises(RouteNotAllowed) as elsewhere:
        gate.admit(ci, "code")
    admitted = gate.admit(ci, "chat")
    with pytest.raises(ClientLimited) as busy:
        gate.admit(ci, "chat")

    assert [answer_for(e.value).message for e in (missing, invalid, elsewhere, busy)] == [
        "missing API key: send it as “Authorization: Bearer <key>”",
        "invalid API key",
        "this API key may not use route “code”",
        "too many requests in flight for this API key (at most 1)",
    ]
    assert busy.value.retry_after == 1
    assert admitted.client is ci


def test_an_admission_a_full_minute_old_no_longer_counts() -> None:
    clock = Clock()
    gate = ClientGate(clock=clock)
    team = ClientSpec("team", per_minute=1)
    gate.configure({"hash-of-team": team})
    gate.admit(team, "chat").release()

    clock.now += 59.5
    with pytest.raises(ClientLimited) as limited:
        gate.admit(team, "chat")
    clock.now += 0.5  # exactly 60 s after the first admission

    gate.admit(team, "chat").release()
    assert answer_for(limited.value).message == (
        "rate limit reached for this API key (1 requests per minute)"
    )
    assert limited.value.retry_after == 1  # half a second, said as the one second to wait


def test_keys_are_optional_by_default_and_nobody_unknown_is_in_flight() -> None:
    gate = ClientGate()

    assert gate.identify(None) is None
    assert gate.in_flight("nobody") == 0
