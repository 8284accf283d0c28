"""Client keys at the door: who is asking, may they use this route, and are they over a limit.

The runtime holds one `ClientGate`, configured from the fleet's enabled keys (by sha256). The
proxy asks it twice, right after resolving the route and before reading the body:
`identify(key_hash)` (401 for a missing or unknown key) and `admit(client, route)` (403 for a
route the key may not use, 429 over its limits), which returns a `ClientPass` that the
request's record gives back when the request ends.

Limits are per key: `max_concurrent` requests from admit to release, and `per_minute` requests
admitted in any sliding 60 seconds (exact: the admission times of the last `per_minute`
requests are kept). A refused request counts against neither.

Loop safety: everything here, `ClientPass.release` included, runs on the gateway's event loop;
nothing is thread-safe.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

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

    def share(self) -> Share:
        """Whose share its requests count against in a host's line (`routing.core.line`)."""
        return Share(self.name, self.priority, self.weight)


@dataclass(slots=True, eq=False)
class _Usage:
    in_flight: int = 0
    admitted: deque[float] = field(default_factory=deque)  # monotonic times, oldest first


class Admitted(Protocol):
    """An admitted request of one client (`ClientPass` here, or one counted in Redis)."""

    def release(self) -> None: ...


class ClientPass:
    """An admitted request of one client. `release` is idempotent."""

    __slots__ = ("client", "_usage", "_released")

    def __init__(self, client: ClientSpec, usage: _Usage) -> None:
        self.client = client
        self._usage = usage
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._usage.in_flight -= 1


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

    def __init__(self, *, require: bool = False, clock: Callable[[], float] = loop_time):
        self._require = require
        self._clock = clock
        self._keys: Mapping[str, ClientSpec] = {}
        self._usage: dict[str, _Usage] = {}  # by client name

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

        Raises RouteNotAllowed, or ClientLimited with `retry_after` in whole seconds.
        """
        if client.routes and route not in client.routes:
            raise RouteNotAllowed(f"this API key may not use route “{route}”")
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
        return ClientPass(client, usage)

    def in_flight(self, name: str) -> int:
        """Requests of the named client admitted and not yet released."""
        usage = self._usage.get(name)
        return usage.in_flight if usage is not None else 0
