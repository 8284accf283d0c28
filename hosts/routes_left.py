"""The routes a drain would leave with no usable host, which the host admin warns of.

Routes are `routing`'s, and `hosts` must not import `routing`, so routing registers the answer
at start (`provide`), as it does the live states (`hosts.live`). Without a provider (a process
without the routing app) no route is ever left.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

# {route name: the hosts, of those about to drain, that are its last usable ones}
RoutesLeft = dict[str, list[str]]

_provider: Callable[[Collection[str]], RoutesLeft] | None = None


def provide(provider: Callable[[Collection[str]], RoutesLeft]) -> None:
    """Register who answers `routes_left_without()` (called once, at app start)."""
    global _provider
    _provider = provider


def routes_left_without(host_names: Collection[str]) -> RoutesLeft:
    """The enabled routes that have a usable host (enabled, not draining) now and would have
    none once the named hosts drain, each with those of the named hosts it has. Sync: reads
    the database."""
    return _provider(host_names) if _provider is not None else {}


def left_lines(left: RoutesLeft) -> list[str]:
    """One sentence per route left with no usable host, for a message or a confirmation page."""
    lines = []
    for route, hosts in left.items():
        names = " and ".join(f"“{name}”" for name in hosts)
        last = "its last usable host" if len(hosts) == 1 else "its last usable hosts"
        lines.append(
            f"Route “{route}”: {names} {'is' if len(hosts) == 1 else 'are'} {last}; with "
            f"{'it' if len(hosts) == 1 else 'them'} draining, new requests to the route find "
            "no host (503, or its fallback if it has one) until one of its hosts stops draining."
        )
    return lines
