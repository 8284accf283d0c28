"""Which prompt prefixes each host's KV cache holds, as far as the gateway can tell.

A request's prompt is cut into fixed-size blocks of a canonical text (`prefix_blocks`), each
named by a hash chained on the hashes before it, so a block matches only with all the blocks
before it: the chain of a conversation's turn N is a prefix of turn N+1's. `PrefixIndex`
keeps, per host and model, the chains sent there, learnt when the host answered and corrected
by what it reported it had cached (llama-server's `timings.cache_n`). Pure: standard library
only, no I/O, no event loop.

The host counts tokens and the index counts characters; `Prefix.cached_blocks` converts with
the request's own ratio of canonical characters to prompt tokens (the host's `prompt_n +
cache_n`). That ratio is the prompt's average, so a prefix whose characters per token differ
from the rest (JSON keys around short messages, a chat template's own tokens) converts a
little off: a comparison of predicted and reported blocks is good to about one block.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BLOCK_CHARS", "BLOCK_TOKENS", "NO_PREFIX", "Prefix", "PrefixIndex", "prefix_blocks"]

# 256 characters of a prompt are some 50-70 tokens of English: a prediction is off by
# less than one block, which is nothing against a prompt worth caching (thousands of tokens),
# while a long conversation stays a few hundred blocks (32k tokens: ~500), so hashing it costs
# tens of microseconds and indexing it a few hundred entries. Smaller blocks would see turn
# boundaries more sharply at more cost per request; larger ones would miss short turns.
BLOCK_CHARS = 256
# A prompt given as token ids: blocks of as many ids as BLOCK_CHARS holds tokens, roughly.
BLOCK_TOKENS = 64

# An entry's owner: its host, its model and the salt of that pair.
_Owner = tuple[str, str, int]


@dataclass(slots=True, frozen=True)
class Prefix:
    """A prompt as the index sees it: the chain of its whole blocks' hashes, and its length.

    `length` counts the units the blocks are cut from (characters of the canonical text, or
    token ids) over the whole prompt, the last partial block included; `block_size` is how
    many of them make a block.
    """

    blocks: tuple[int, ...]
    length: int
    block_size: int

    def cached_blocks(self, prompt_tokens: int | None, cached_tokens: int | None) -> int | None:
        """The leading whole blocks that `cached_tokens` of the prompt's `prompt_tokens` cover
        (see the module's docstring for the approximation); None when either count is
        unknown, the prompt is empty or has no whole block."""
        if not self.blocks or prompt_tokens is None or cached_tokens is None or prompt_tokens <= 0:
            return None
        covered = min(cached_tokens, prompt_tokens) * self.length // prompt_tokens
        return min(covered // self.block_size, len(self.blocks))


NO_PREFIX = Prefix((), 0, BLOCK_CHARS)


def prefix_blocks(body: object) -> Prefix:
    """The prompt of a parsed request body, cut into blocks as the host will see it.

    A chat body (`messages`): its `tools`, Anthropic's `system`, then each message; a Responses
    body (`input`): its `tools`, `instructions`, then the input (a string, or each item); a
    completion body: a `prompt` string, or token ids (a one-element list counts as its
    element). Each part is canonical (a role and a text content as they are, anything else as
    JSON with sorted keys and no spaces), so key order and whitespace between tokens do not
    matter, and parts only ever append: an earlier part that changes changes every later
    block. A batch of prompts, a mixed prompt and an infill body have no prefix (the host's
    counts cover several prompts, or a text it assembles itself). Only whole blocks are
    hashed. Pure; never raises, whatever `body` holds.
    """
    if not isinstance(body, dict):
        return NO_PREFIX
    try:
        return _prefix(body)
    except (TypeError, ValueError, RecursionError):
        return NO_PREFIX  # not JSON: a body built in code


def _prefix(body: dict[str, object]) -> Prefix:
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        return _text("chat", [*_heads(body, "tools", "system"), *messages])
    given = body.get("input")
    if isinstance(given, (str, list)) and given:
        items = [given] if isinstance(given, str) else given
        return _text("responses", [*_heads(body, "tools", "instructions"), *items])
    if "input_prefix" in body or "input_suffix" in body or "input_extra" in body:
        return NO_PREFIX  # infill: the host puts the extra context first, in its own order
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return Prefix(_chain("prompt", prompt, BLOCK_CHARS), len(prompt), BLOCK_CHARS)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return _tokens(prompt)
    return NO_PREFIX


# Between parts, and between a message's role and its content: control characters no JSON
# text holds unescaped. A content that holds them itself could pass for other parts, which
# would only mislead the index about that client's own prompts.
_SEPARATOR = "\x1e"
_ROLE = "\x1f"


def _heads(body: dict[str, object], *keys: str) -> list[object]:
    # Each under its own key, so that a tools list is never read as a message.
    return [{key: body[key]} for key in keys if key in body]


def _part(item: object) -> str:
    """One part's canonical text. The common message, a role and a text, is taken as it is
    (escaping it as JSON cost four times as much: bench/bench_prefixes.py)."""
    if type(item) is dict and len(item) == 2:
        role, content = item.get("role"), item.get("content")
        if type(role) is str and type(content) is str:
            return role + _ROLE + content
    return json.dumps(item, sort_keys=True, separators=(",", ":"))


def _text(kind: str, parts: list[object]) -> Prefix:
    text = _SEPARATOR.join(map(_part, parts))
    return Prefix(_chain(kind, text, BLOCK_CHARS), len(text), BLOCK_CHARS)


def _tokens(ids: list[int]) -> Prefix:
    return Prefix(_chain("tokens", ids, BLOCK_TOKENS), len(ids), BLOCK_TOKENS)


def _chain(kind: str, units: str | list[int], size: int) -> tuple[int, ...]:
    """Each whole block's hash, chained on the hash before it; `kind` seeds the chain, so
    chat, Responses, text and token prompts stay apart.

    Python's own hash: SipHash, keyed afresh in every process, so a client cannot make two
    prompts collide on purpose, and fast (a quarter of blake2b's cost here). Its values differ
    between processes, which suits an index each process keeps for itself (docs/replicas.md).
    """
    running = hash(kind)
    chain = []
    for end in range(size, len(units) + 1, size):
        block = units[end - size : end]
        running = hash((running, block if isinstance(block, str) else tuple(block)))
        chain.append(running)
    return tuple(chain)


class PrefixIndex:
    """Per host and model, the block chains the index believes the host's KV cache holds.

    A bounded LRU of (host, model, block) entries: at most `max_entries`, the least recently
    learnt going first. `learn` refreshes a chain's blocks from its last to its first, so a
    block is always fresher than any block after it: eviction shortens chains from their ends,
    never cuts one in the middle. `match` and `deepest` only read. Memory: about 150 bytes an
    entry (bench/bench_prefixes.py), and a set of its hosts per block held. Not thread-safe:
    call from one event loop; nothing here suspends.
    """

    __slots__ = ("max_entries", "_entries", "_salts", "_holders")

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self.max_entries = max_entries
        # An entry is its block's hash XOR a random salt of its (host, model), and says its
        # owner, one tuple (host, model, salt) shared by the pair's entries: one int per lookup
        # instead of a tuple to build and hash (a quarter of the cost of `learn`). Two entries
        # collide with a chance of one in 2**64.
        self._entries: OrderedDict[int, _Owner] = OrderedDict()
        # Per model, each host's owner tuple: a lookup per host without building a key.
        self._salts: dict[str, dict[str, _Owner]] = {}
        # Per model, the hosts holding each block: `deepest` reads the hosts that hold the
        # prompt's blocks, not the route's hosts.
        self._holders: dict[str, dict[int, set[str]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def learn(self, host: str, model: str, chain: tuple[int, ...]) -> None:
        """The host now holds `chain` (it was sent there and answered)."""
        hosts = self._salts.setdefault(model, {})
        owner = hosts.get(host)
        if owner is None:
            owner = hosts[host] = (host, model, random.getrandbits(64))
        salt, entries = owner[2], self._entries
        holders = self._holders.setdefault(model, {})
        for block in reversed(chain[: self.max_entries]):
            key = block ^ salt
            if key in entries:
                entries.move_to_end(key)
            else:
                entries[key] = owner
                holders.setdefault(block, set()).add(host)
        while len(entries) > self.max_entries:
            self._unhold(*entries.popitem(last=False))

    def match(self, host: str, model: str, chain: tuple[int, ...]) -> int:
        """How many leading blocks of `chain` the index believes the host holds."""
        owner = self._salts.get(model, {}).get(host)
        if owner is None:
            return 0
        salt, entries = owner[2], self._entries
        for depth, block in enumerate(chain):
            if block ^ salt not in entries:
                return depth
        return len(chain)

    def deepest(
        self,
        hosts: Sequence[str],
        model: str,
        chain: tuple[int, ...],
        beyond: int,
        places: Mapping[str, Any] | None = None,
    ) -> tuple[str, int] | None:
        """Of `hosts`, the one believed to hold the most leading blocks of `chain`, when that
        is more than `beyond`, with its count (the first given among equals); else None.

        `places`: each of `hosts`'s place in their order (any values that sort so), when the
        caller has them; without, they are counted out, at a cost of the number of hosts.

        The chain is read from its end: the first block, from the last, that one of `hosts`
        holds with every block before it gives the depth, and only that block's holders are
        looked at. So a lookup costs the blocks past the deepest match and the hosts holding
        that block, not the route's hosts: on 2,000 hosts sharing a system prompt each
        request used to look at every host (bench/twin, "Scale").
        """
        if places is None:
            places = {host: place for place, host in reversed(list(enumerate(hosts)))}
        held = self._holders.get(model, {})
        for depth in range(len(chain), max(beyond, 0), -1):
            holders = held.get(chain[depth - 1])
            if holders:
                found = self._first_at(hosts, places, holders, model, chain, depth)
                if found is not None:
                    return found, depth
        return None

    def _first_at(
        self,
        hosts: Sequence[str],
        places: Mapping[str, Any],
        holders: set[str],
        model: str,
        chain: tuple[int, ...],
        depth: int,
    ) -> str | None:
        """The first of `hosts` among `holders` that holds `depth` leading blocks of `chain`
        (none holds more). From the smaller side: the holders, or the hosts in order up to the
        first that does (a shared block: nearly always the first)."""
        if len(holders) <= len(places) // 8:
            found = [
                (places[host], host)
                for host in holders
                if host in places and self.match(host, model, chain) == depth
            ]
            return min(found)[1] if found else None
        for host in hosts:
            if host in holders and self.match(host, model, chain) == depth:
                return host
        return None

    def correct(self, host: str, model: str, chain: tuple[int, ...], cached_blocks: int) -> None:
        """The host reported holding only `cached_blocks` leading blocks of `chain`: forget
        its blocks of the chain past them."""
        owner = self._salts.get(model, {}).get(host)
        if owner is None:
            return
        entries = self._entries
        for block in chain[max(cached_blocks, 0) :]:
            key = block ^ owner[2]
            if entries.pop(key, None) is not None:
                self._unhold(key, owner)

    def forget(self, hosts: Iterable[str]) -> None:
        """Forget everything the hosts held (gone, or another machine under the same name).
        Costs a pass over every entry: for a reload, not for a request."""
        gone = set(hosts)
        if not gone:
            return
        for key, owner in self._entries.items():
            if owner[0] in gone:
                self._unhold(key, owner)
        self._entries = OrderedDict(
            (key, owner) for key, owner in self._entries.items() if owner[0] not in gone
        )
        self._salts = {
            model: {host: owner for host, owner in hosts.items() if host not in gone}
            for model, hosts in self._salts.items()
        }

    def _unhold(self, key: int, owner: _Owner) -> None:
        """The entry `key` of `owner` is gone: its host no longer holds that block."""
        host, model, salt = owner
        holders = self._holders[model]
        block = key ^ salt
        hosts = holders.get(block)
        if hosts is not None:
            hosts.discard(host)
            if not hosts:
                del holders[block]
