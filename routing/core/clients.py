"""Client keys at the door: who is asking, may they use this route, and are they over a limit.

The runtime holds one `ClientGate`, configured from the fleet's enabled keys (by sha256). The
proxy asks it twice, right after resolving the route and before reading the body:
`identify(key_hash)` (401 for a missing or unknown key) and `admit(client, route)` (403 for a
route the key may not use, 429 over its limits), which returns a `ClientPass` that the
request's record gives back when the request ends.

Limits are per key: `max_concurrent` requests from admit to release, and `per_minute` requests
admitted in any sliding 60 seconds (exact: the admission times of the last `per_minute`
requests are kept). A refused request counts against neither. Token budgets per UTC day and
month (routing/core/budgets.py) are checked first: a pass's `release(tokens)` adds what its
request spent to the key's `Ledger`.

Loop safety: everything here, `ClientPass.release` included, runs on the gateway's event loop;
nothing is thread-safe.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from routing.core.budgets import Ledger, exhausted
from routing.core.clock import loop_time
from routing.core.errors import ClientLimited, InvalidKey, MissingKey, RouteNotAllowed
from routing.core.fairness import Priority, Share

__all__ = ["Admitted", "ClientGate", "ClientPass", "ClientSpec", "bearer_token"]

WINDOW = 60.0


@dataclass(slots=True, frozen=True)
class ClientSpec:
    """One enabled client key as configured; `routes` empty means every route."""

    name: str
    routes: frozenset[str] = frozenset()
    max_concurrent: int | None = None
    per_minute: int | None = None
    priority: Priority = Priority.STANDARD  # its requests' class in a host's line
    weight: float = 1.0  # its share of its class's slots while it waits (> 0)
    tokens_per_day: int | None = None  # its budget per UTC day (routing/core/budgets.py)
    tokens_per_month: int | None = None  # and per UTC month

    @property
    def budgeted(self) -> bool:
        return self.tokens_per_day is not None or self.tokens_per_month is not None

    def share(self) -> Share:
        """Whose share its requests count against in a host's line (`routing.core.line`)."""
        return Share(self.name, self.priority, self.weight)


@dataclass(slots=True, eq=False)
class _Usage:
    in_flight: int = 0
    admitted: deque[float] = field(default_factory=deque)  # monotonic times, oldest first


class Admitted(Protocol):
    """An admitted request of one client (`ClientPass` here, or one counted in Redis)."""

    def release(self, tokens: int = 0) -> None:
        """The request ended, having spent `tokens` (prompt and generated, as its row says)."""
        ...


class ClientPass:
    """An admitted request of one client. `release` is idempotent: the first counts."""

    __slots__ = ("client", "_usage", "_gate", "_released")

    def __init__(self, client: ClientSpec, usage: _Usage, gate: ClientGate) -> None:
        self.client = client
        self._usage = usage
        self._gate = gate
        self._released = False

    def release(self, tokens: int = 0) -> None:
        if self._released:
            return
        self._released = True
        self._usage.in_flight -= 1
        if tokens:
            self._gate.ledger.add(self.client.name, tokens, self._gate.now())


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header; "" for anything else."""
    if not authorization:
        return ""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class ClientGate:
    """Checks requests against the configured client keys and counts what each key runs.

    Keys are required when any key is configured, or always when `require` is set.
    """

    def __init__(
        self,
        *,
        require: bool = False,
        clock: Callable[[], float] = loop_time,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self._require = require
        self._clock = clock
        self.now = now  # the wall clock budgets' days and months are read on
        self._keys: Mapping[str, ClientSpec] = {}
        self._usage: dict[str, _Usage] = {}  # by client name
        self.ledger = Ledger()

    @property
    def required(self) -> bool:
        return self._require or bool(self._keys)

    def configure(self, keys: Mapping[str, ClientSpec]) -> None:
        """Set the enabled keys ({sha256 hex: spec}), keeping the counts of keys that remain.

        New limits apply to the next admission; passes already out release normally.
        """
        names = {spec.name for spec in keys.values()}
        self._keys = dict(keys)
        for name in [name for name in self._usage if name not in names]:
            del self._usage[name]
        self.ledger.keep_only(names)

    def names(self) -> set[str]:
        """The names of the keys configured now."""
        return {spec.name for spec in self._keys.values()}

    def identify(self, key_hash: str | None) -> ClientSpec | None:
        """The client presenting the key with this sha256 (hex); None when keys are not required.

        Raises MissingKey (no key presented) or InvalidKey. The key is never in a message.
        """
        if not self.required:
            return None
        if not key_hash:
            raise MissingKey("missing API key: send it as “Authorization: Bearer <key>”")
        client = self._keys.get(key_hash)
        if client is None:
            raise InvalidKey("invalid API key")
        return client

    def admit(self, client: ClientSpec, route: str) -> ClientPass:
        """Count a request of `client` on `route` and return its pass.

        Raises RouteNotAllowed, BudgetExhausted or ClientLimited, with `retry_after` in whole
        seconds.
        """
        if client.routes and route not in client.routes:
            raise RouteNotAllowed(f"this API key may not use route “{route}”")
        if client.budgeted:
            wall = self.now()
            spend = self.ledger.spend(client.name, wall)
            refusal = exhausted(client.tokens_per_day, client.tokens_per_month, spend, wall)
            if refusal is not None:
                raise refusal
        now = self._clock()
        usage = self._usage.get(client.name)
        if usage is None:
            usage = self._usage[client.name] = _Usage()
        if client.max_concurrent is not None and usage.in_flight >= client.max_concurrent:
            raise ClientLimited(
                f"too many requests in flight for this API key (at most {client.max_concurrent})",
                retry_after=1,
            )
        admitted = usage.admitted
        while admitted and admitted[0] <= now - WINDOW:
            admitted.popleft()
        if client.per_minute is not None:
            while len(admitted) > client.per_minute:  # the limit was lowered
                admitted.popleft()
            if len(admitted) >= client.per_minute:
                wait = admitted[0] + WINDOW - now
                raise ClientLimited(
                    f"rate limit reached for this API key ({client.per_minute} requests "
                    "per minute)",
                    retry_after=max(1, math.ceil(wait)),
                )
            admitted.append(now)
        usage.in_flight += 1
        return ClientPass(client, usage, self)

    def in_flight(self, name: str) -> int:
        """Requests of the named client admitted and not yet released."""
        usage = self._usage.get(name)
        return usage.in_flight if usage is not None else 0
