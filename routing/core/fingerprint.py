"""Name a conversation so that every turn of it maps to the same lease."""

from __future__ import annotations

import hashlib
import json

__all__ = ["fingerprint"]

_PROMPT_CHARS = 2_048

# Methods that carry no conversation and so never get a lease.
_NO_LEASE_METHODS = frozenset({"GET", "HEAD"})


def fingerprint(method: str, body: object, session: str | None) -> str:
    """Return the hex sha256 naming the request's conversation, or "" when it has none.

    In order: GET and HEAD have none; a non-empty ``session`` (the ``X-Crossbar-Session``
    header) names it; a chat body's ``messages`` (with Anthropic's top-level ``system``) up to
    and including the first user message name it, canonicalised so key order and whitespace
    do not matter; a Responses body's ``instructions`` and ``input`` (a string, or its items up
    to the first user item) name it; a completion or infill body's ``prompt`` (a string, a
    list of strings, or token ids) names it by its first 2,048 characters or tokens. The kinds
    are hashed in separate domains, so they cannot collide. Pure; never raises, whatever
    ``body`` holds.
    """
    if method.upper() in _NO_LEASE_METHODS:
        return ""
    if session:
        return _digest(b"session", session)
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        head: list[object] = _conversation_head(messages)
        if "system" in body:  # Anthropic's messages API keeps the system prompt outside
            head = [{"system": body["system"]}, *head]
        canonical = _canonical(head)
        if canonical:
            return _digest(b"chat", canonical)
    given = body.get("input")
    if isinstance(given, (str, list)) and given:
        opening = given if isinstance(given, str) else _conversation_head(given)
        canonical = _canonical([body.get("instructions"), opening])
        if canonical:
            return _digest(b"responses", canonical)
    return _prompt_digest(body.get("prompt"))


def _prompt_digest(prompt: object) -> str:
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch of prompts, or of token lists: the first names it
    if isinstance(prompt, str) and prompt:
        return _digest(b"prompt", prompt[:_PROMPT_CHARS])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        tokens = ",".join(str(t) for t in prompt[:_PROMPT_CHARS])
        return _digest(b"tokens", tokens)
    return ""


def _conversation_head(messages: list[object]) -> list[object]:
    # Everything after the first user message grows turn by turn; what comes before it and the
    # message itself are what the conversation was opened with. Without a user message at all
    # the whole list is the best name there is.
    for index, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return messages[: index + 1]
    return messages


def _canonical(value: object) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        # Not JSON (a body built in code, not parsed): no stable name, so no lease.
        return ""


def _digest(kind: bytes, text: str) -> str:
    # The NUL after the kind keeps the domains apart; surrogatepass because JSON may carry lone
    # surrogates ("\ud800"), which strict UTF-8 refuses.
    payload = kind + b"\0" + text.encode("utf-8", "surrogatepass")
    return hashlib.sha256(payload).hexdigest()
