"""Which web pages may read a route's answers: the CORS rule, in one function.

A browser sends `Origin` with a cross-site request and lets the page read the answer only when
the answer names that origin (`Access-Control-Allow-Origin`). Naming every origin, with
`Access-Control-Allow-Credentials: true`, as llama-server long did, lets any page a user opens
drive the fleet through that user's browser. The rule:

- A route that lists origins (`cors_origins`) names exactly those, with credentials allowed.
  `*` in the list lets every other origin read answers too (`Access-Control-Allow-Origin: *`),
  never with credentials.
- A route that lists none answers as llama-server does once its tools are enabled (its
  `--cors-origins` default then narrows to localhost): a page served from this machine's
  loopback names (`http://localhost:5173`, `https://127.0.0.1:8443`, `http://[::1]`) may read
  answers, without credentials; no other origin is named.

Pure: strings in, a `Grant` (or None: no CORS headers at all) out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANY = "*"
# scheme://host[:port] and nothing else: no path, query, fragment or user (an origin as a
# browser writes it; a trailing slash would never match one).
_ORIGIN = re.compile(r"https?://[^\s/?#@]+", re.IGNORECASE)
# The loopback names exactly: `http://localhost.evil.com` and `http://notlocalhost` are not.
_LOOPBACK = re.compile(r"https?://(?:localhost|127\.0\.0\.1|\[::1\])(?::[0-9]{1,5})?")


@dataclass(slots=True, frozen=True)
class Grant:
    """What an answer tells the browser: the origin it names, and whether credentials
    (cookies, HTTP authentication) may come with the request."""

    origin: str
    credentials: bool


def parse_origins(text: str) -> frozenset[str]:
    """The origins a route's `cors_origins` lists, separated by spaces or commas, lower-cased
    as browsers write them."""
    return frozenset(origin.lower() for origin in text.replace(",", " ").split())


def not_origins(text: str) -> list[str]:
    """The entries of `text` that are neither an origin (`scheme://host[:port]`) nor `*`."""
    return [entry for entry in parse_origins(text) if entry != ANY and not _ORIGIN.fullmatch(entry)]


def grant(listed: frozenset[str], origin: str | None) -> Grant | None:
    """What to tell a browser whose page at `origin` asks a route that lists `listed`.

    None when no CORS header may be sent: no origin, or one the rule does not allow.
    """
    if not origin:
        return None
    if listed:
        if origin in listed:
            return Grant(origin, credentials=True)
        return Grant(ANY, credentials=False) if ANY in listed else None
    return Grant(origin, credentials=False) if _LOOPBACK.fullmatch(origin) else None
