"""When two hosts' URLs lead to one engine: the address a URL names, and the clash it makes.

Two hosts at one address are one box counted twice: the gateway would let the sum of their
`parallel` run on it at once, more than it has slots. So a host whose address another host has
is an error, unless every host at that address says it shares it on purpose (`shares_url`: a
proxy that fans out to several boxes). The admin's host form, `crossbar_config check` and
`load` ask `url_clash()`, so the rule and its words are the same wherever a host comes from.

The address is worked out from the URL's text alone, with no DNS lookup: scheme and host name
are compared without case, a default port (80 for http, 443 for https) equals no port, a
trailing slash is dropped, and the loopback names `localhost`, `127.0.0.1` and `[::1]` are one
address. `gpu1` and `10.0.0.5` stay two addresses even if one resolves to the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol
from urllib.parse import urlsplit

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Listed(Protocol):
    """A host as the rule sees it: a `Host` row or a configuration's spec of one."""

    @property
    def name(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def shares_url(self) -> bool: ...


def address(url: str) -> str:
    """The engine `url` leads to, as text two URLs share exactly when they lead to one place."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = parts.hostname or ""  # lower-cased, without an IPv6 address's brackets
    if host in _LOOPBACK:
        host = "localhost"
    try:
        port = parts.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:  # not a port number: the URL's own validator refuses it
        port = None
    query = f"?{parts.query}" if parts.query else ""
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}{query}"


def url_clash(host: Listed, others: Iterable[Listed]) -> str | None:
    """What is wrong when other hosts have `host`'s address; None when nothing is.

    Sharing an address is allowed only when `host` and every other host there say so
    (`shares_url`). `others` may hold `host` itself and hosts elsewhere; both are skipped.
    """
    if not host.url:
        return None
    here = address(host.url)
    same = [o for o in others if o.name != host.name and o.url and address(o.url) == here]
    if not same or (host.shares_url and all(other.shares_url for other in same)):
        return None
    names = _quoted([other.name for other in same])
    written = sorted({other.url for other in same if other.url != host.url})
    also = f" (as {', '.join(written)})" if written else ""
    unmarked = ", ".join(f"“{h.name}”" for h in (host, *same) if not h.shares_url)
    return (
        f"{'Host' if len(same) == 1 else 'Hosts'} {names} {'has' if len(same) == 1 else 'have'} "
        f"this URL too{also}: two hosts for one box let it run the sum of their parallel at "
        "once, more than its slots. Keep one host per box; or, if this URL really leads to "
        "several boxes (a proxy that fans out), set shares_url (“Shares URL” in the admin) on "
        f"each host with it (not set: {unmarked})."
    )


def _quoted(names: list[str]) -> str:
    quoted = [f"“{name}”" for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"
