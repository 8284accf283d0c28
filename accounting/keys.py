"""Client keys as secrets: how one is made, how it is stored, and how it is recognized.

A key is 32 random bytes (`cb-` + URL-safe base64), so a plain sha256 is enough to store it:
there is no dictionary to attack, and a fast hash keeps the per-request check at a microsecond.
No Django here: the gateway's runtime hashes the key a request presents with the same function.
"""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "cb-"
SHOWN_PREFIX = 8  # "cb-" and five random characters: enough to tell keys apart, useless to guess


def new_key() -> str:
    """A fresh random client key."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored form of a key: sha256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def shown_prefix(key: str) -> str:
    """The non-secret start of a key, kept so people can recognize it in lists."""
    return key[:SHOWN_PREFIX]
