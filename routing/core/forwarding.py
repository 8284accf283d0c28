"""Who the client is, as a host is told it: `X-Forwarded-For` and `Forwarded` (RFC 7239).

A client can write any forwarding header it likes, so the gateway believes one only from a
peer it was told to trust (`CROSSBAR_TRUSTED_PROXIES`: the reverse proxies in front of it) and
then appends that peer to the chain. From any other peer the client's `X-Forwarded-For`,
`X-Forwarded-Host`, `X-Forwarded-Proto` and `Forwarded` are dropped (`FORWARDING`), and the
peer address the gateway itself sees is the whole chain.

Pure: plain strings in, header pairs out.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from ipaddress import (
    IPv4Address,
    IPv4Network,
    IPv6Address,
    IPv6Network,
    ip_address,
    ip_network,
)

# The client's forwarding headers: never passed on as they came.
FORWARDING = frozenset({"x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "forwarded"})
_KEPT_FROM_PROXIES = ("X-Forwarded-Host", "X-Forwarded-Proto")

Networks = tuple[IPv4Network | IPv6Network, ...]


def trusted_networks(entries: Iterable[str]) -> Networks:
    """IP addresses and networks (`10.0.0.5`, `10.1.0.0/16`, `fd00::/8`) as networks.

    Raises ValueError naming an entry that is neither.
    """
    networks = []
    for entry in entries:
        try:
            networks.append(ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"“{entry}” is not an IP address or network") from None
    return tuple(networks)


def forwarding_headers(
    peer: str, headers: Mapping[str, str], trusted: Networks
) -> Sequence[tuple[str, str]]:
    """The forwarding headers a host gets for a request that came from `peer` (its address,
    as the server saw the connection) with `headers` (case-insensitive, as Django's
    `request.headers`, where repeated headers are already joined with commas)."""
    if not trusted or not _is_trusted(peer, trusted):
        return _peer_only(peer)
    node = _node(peer)
    chain = headers.get("X-Forwarded-For")
    forwarded = headers.get("Forwarded")
    return [
        *((name, headers[name]) for name in _KEPT_FROM_PROXIES if name in headers),
        ("X-Forwarded-For", f"{chain}, {node}" if chain else node),
        ("Forwarded", f"{forwarded}, for={_quoted(node)}" if forwarded else f"for={_quoted(node)}"),
    ]


# Cached per peer: a gateway sees a few proxies and clients, many times each (4 us a request
# uncached, measured).
@functools.lru_cache(maxsize=1024)
def _peer_only(peer: str) -> tuple[tuple[str, str], ...]:
    node = _node(peer)
    return (("X-Forwarded-For", node), ("Forwarded", f"for={_quoted(node)}"))


@functools.lru_cache(maxsize=1024)
def _is_trusted(peer: str, trusted: Networks) -> bool:
    address = _address(peer)
    return address is not None and any(address in network for network in trusted)


def _address(peer: str) -> IPv4Address | IPv6Address | None:
    """The peer's IP address; an IPv4 peer as a dual-stack socket shows it (`::ffff:a.b.c.d`)
    as IPv4. None when the peer has no IP address (a Unix socket)."""
    try:
        address = ip_address(peer)
    except ValueError:
        return None
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _node(peer: str) -> str:
    """The peer as a chain entry: its address, or `unknown` (RFC 7239 6.1)."""
    address = _address(peer)
    return "unknown" if address is None else str(address)


def _quoted(node: str) -> str:
    """A `Forwarded` node: an IPv6 address is bracketed and quoted (RFC 7239 6)."""
    return f'"[{node}]"' if ":" in node else node
