"""The prefix index: prompts cut into chained blocks, and what each host is believed to hold."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.core.prefixes import (
    BLOCK_CHARS,
    BLOCK_TOKENS,
    NO_PREFIX,
    Prefix,
    PrefixIndex,
    prefix_blocks,
)

SYSTEM = " ".join(f"rule{i}" for i in range(400))  # some 3,000 characters: a dozen blocks


def conversation(turns: int, system: str = SYSTEM) -> dict[str, object]:
    messages: list[dict[str, object]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        # A message of more than a role and a text goes as JSON: its keys in any order too.
        messages.append({"role": "user", "name": "ann", "content": f"question {turn} " * 20})
        messages.append({"role": "assistant", "content": f"answer {turn} " * 30})
    messages.append({"role": "user", "content": "and now?"})
    return {"model": "m", "messages": messages}


def test_equal_prompts_give_equal_chains_whatever_the_key_order_or_whitespace():
    body = conversation(2)
    reordered = json.loads(json.dumps(body, indent=4))  # the same document, spaced out
    reordered["messages"] = [dict(reversed(list(m.items()))) for m in reordered["messages"]]

    assert prefix_blocks(reordered) == prefix_blocks(body)
    assert len(prefix_blocks(body).blocks) > 10


def test_the_next_turn_extends_the_chain_of_the_last():
    first, second = prefix_blocks(conversation(1)), prefix_blocks(conversation(2))

    shared = len(first.blocks) - 1  # the last whole block ends inside the final user message
    assert second.blocks[:shared] == first.blocks[:shared]
    assert len(second.blocks) > len(first.blocks)


def test_a_changed_early_message_changes_every_later_block():
    body = conversation(3)
    changed = conversation(3)
    messages = changed["messages"]
    assert isinstance(messages, list)
    # As long as the first question, so every later block holds the same text as before.
    messages[1] = {"role": "user", "name": "ann", "content": "QUESTION 0 " * 20}
    original, edited = prefix_blocks(body).blocks, prefix_blocks(changed).blocks

    first_changed = len(f"system {SYSTEM} ") // BLOCK_CHARS  # the block the question begins
    assert original[:first_changed] == edited[:first_changed]
    assert not set(original[first_changed:]) & set(edited[first_changed:])


def test_only_whole_blocks_are_hashed_and_the_length_counts_them_all():
    prompt = "x" * (3 * BLOCK_CHARS + 10)

    prefix = prefix_blocks({"prompt": prompt})

    assert len(prefix.blocks) == 3
    assert prefix.length == 3 * BLOCK_CHARS + 10
    assert prefix_blocks({"prompt": "short"}).blocks == ()


def test_tools_come_before_the_messages_and_change_the_whole_chain():
    plain = conversation(1)
    with_tools = {**plain, "tools": [{"type": "function", "function": {"name": "f"}}]}

    assert prefix_blocks(with_tools).blocks[0] != prefix_blocks(plain).blocks[0]


def test_responses_completions_and_token_prompts_have_chains_of_their_own():
    text = "word " * 200
    responses = prefix_blocks({"instructions": "be brief", "input": text})
    completion = prefix_blocks({"prompt": text})
    one_of_a_list = prefix_blocks({"prompt": [text]})
    tokens = prefix_blocks({"prompt": list(range(3 * BLOCK_TOKENS))})

    assert responses.blocks and completion.blocks and tokens.blocks
    assert completion == one_of_a_list
    assert responses.blocks[0] != completion.blocks[0]
    assert len(tokens.blocks) == 3 and tokens.length == 3 * BLOCK_TOKENS
    assert tokens.block_size == BLOCK_TOKENS


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        "prompt",
        {},
        {"messages": []},
        {"prompt": ""},
        {"prompt": ["a" * 600, "b" * 600]},  # a batch: the host's counts cover both
        {"prompt": ["a" * 600, 12, 13]},  # a mixed prompt
        {"prompt": "a" * 600, "input_prefix": "def f():"},  # infill
        {"messages": [{"content": object()}]},  # not JSON: a body built in code
    ],
)
def test_a_body_without_a_usable_prompt_has_no_prefix_and_never_raises(body: object):
    assert prefix_blocks(body) == NO_PREFIX


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), lambda inner: (
    st.lists(inner) | st.dictionaries(st.text(), inner)), max_leaves=30))  # fmt: skip
def test_any_json_body_gives_a_prefix(body: object):
    assert isinstance(prefix_blocks({"messages": [body], "prompt": body}), Prefix)


def test_cached_tokens_convert_to_blocks_by_the_prompts_own_ratio():
    prefix = Prefix(tuple(range(10)), 10 * BLOCK_CHARS + 100, BLOCK_CHARS)  # 2,660 characters

    assert prefix.cached_blocks(1000, 500) == 5  # half the tokens: 1,330 characters
    assert prefix.cached_blocks(1000, 1000) == 10  # the whole prompt: every whole block
    assert prefix.cached_blocks(1000, 0) == 0
    assert prefix.cached_blocks(1000, 5000) == 10  # never past the prompt
    assert prefix.cached_blocks(None, 500) is None  # unknown is not 0
    assert prefix.cached_blocks(1000, None) is None
    assert prefix.cached_blocks(0, 0) is None
    assert NO_PREFIX.cached_blocks(1000, 500) is None


def test_a_learnt_chain_matches_on_its_host_and_model_only():
    index = PrefixIndex(100)
    chain = (1, 2, 3, 4)

    index.learn("gpu1", "m", chain)

    assert index.match("gpu1", "m", chain) == 4
    assert index.match("gpu1", "m", (1, 2, 9, 4)) == 2  # a block counts only after its parents
    assert index.match("gpu1", "m", (1, 2, 3, 4, 5, 6)) == 4
    assert index.match("gpu2", "m", chain) == 0
    assert index.match("gpu1", "other", chain) == 0


def test_the_entry_cap_holds_and_drops_the_least_recently_learnt_ends_first():
    index = PrefixIndex(6)
    old, new = (1, 2, 3, 4), (5, 6, 7, 8)
    index.learn("gpu1", "m", old)
    index.learn("gpu1", "m", new)

    assert len(index) == 6
    assert index.match("gpu1", "m", new) == 4
    assert index.match("gpu1", "m", old) == 2  # its tail went first, its head is still there


def test_a_chain_longer_than_the_cap_keeps_its_head():
    index = PrefixIndex(3)

    index.learn("gpu1", "m", tuple(range(10)))

    assert len(index) == 3
    assert index.match("gpu1", "m", tuple(range(10))) == 3


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.lists(
    st.integers(0, 5), max_size=12)), max_size=40), st.integers(1, 20))  # fmt: skip
def test_the_cap_holds_whatever_is_learnt(learnt: list[tuple[str, list[int]]], cap: int):
    index = PrefixIndex(cap)
    for host, blocks in learnt:
        index.learn(host, "m", tuple(blocks))
        assert len(index) <= cap


def test_correct_forgets_the_hosts_blocks_past_what_it_reported():
    index = PrefixIndex(100)
    chain = (1, 2, 3, 4, 5)
    index.learn("gpu1", "m", chain)
    index.learn("gpu2", "m", chain)

    index.correct("gpu1", "m", chain, 2)

    assert index.match("gpu1", "m", chain) == 2
    assert len(index) == 2 + 5
    assert index.match("gpu2", "m", chain) == 5  # another host's word is its own


def test_deepest_names_the_host_holding_the_most_of_the_chain_past_a_depth():
    index = PrefixIndex(100)
    chain = (1, 2, 3, 4, 5)
    index.learn("gpu1", "m", chain[:2])
    index.learn("gpu2", "m", chain[:4])
    index.learn("gpu3", "m", chain[:4])  # as deep as gpu2, later in the order given
    index.learn("gpu4", "m", (9, 9))
    hosts = ["gpu1", "gpu2", "gpu3", "gpu4", "gpu5"]

    assert index.deepest(hosts, "m", chain, beyond=0) == ("gpu2", 4)
    assert index.deepest(hosts, "m", chain, beyond=2) == ("gpu2", 4)
    assert index.deepest(hosts, "m", chain, beyond=4) is None  # none holds more than 4
    assert index.deepest(["gpu1", "gpu4"], "m", chain, beyond=0) == ("gpu1", 2)
    assert index.deepest(hosts, "other", chain, beyond=0) is None  # another model's cache


def test_deepest_counts_a_host_from_the_first_block_when_its_chain_has_a_hole():
    index = PrefixIndex(100)
    chain = (1, 2, 3, 4, 5)
    index.learn("gpu1", "m", chain)
    index.learn("gpu2", "m", chain[:3])
    index.correct("gpu1", "m", chain, 1)  # gpu1 holds block 1 alone now
    index.learn("gpu1", "m", (7, 8, 9))
    index.learn("gpu1", "m", chain[3:])  # blocks 4 and 5, but not 2 and 3 before them

    assert index.deepest(["gpu1", "gpu2"], "m", chain, beyond=1) == ("gpu2", 3)
    assert index.deepest(["gpu1"], "m", chain, beyond=3) is None


def test_forgetting_a_host_forgets_only_its_blocks():
    index = PrefixIndex(100)
    index.learn("gpu1", "m", (1, 2))
    index.learn("gpu2", "m", (1, 2))

    index.forget(["gpu1"])

    assert index.match("gpu1", "m", (1, 2)) == 0
    assert index.match("gpu2", "m", (1, 2)) == 2
    assert len(index) == 2


def test_an_index_holds_at_least_one_entry():
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_deepest_finds_a_host_one_block_deeper_than_the_deepest_before_it_in_the_order():
    """Each host deeper than those before it wins in turn, by a single block too; a host that
    holds the whole chain ends the search (none can hold more)."""
    index = PrefixIndex(100)
    chain = (1, 2, 3, 4, 5)
    for depth, host in enumerate(("gpu1", "gpu2", "gpu3", "gpu4", "gpu5"), start=1):
        index.learn(host, "m", chain[:depth])
    index.learn("gpu6", "m", chain)  # as deep as gpu5, after it

    assert index.deepest(["gpu1", "gpu2"], "m", chain, beyond=0) == ("gpu2", 2)
    assert index.deepest(["gpu1", "gpu2", "gpu3"], "m", chain, beyond=0) == ("gpu3", 3)
    assert index.deepest(["gpu2", "gpu1", "gpu4"], "m", chain, beyond=1) == ("gpu4", 4)
    assert index.deepest(["gpu5", "gpu6", "gpu1"], "m", chain, beyond=0) == ("gpu5", 5)


class _Counted(list[str]):
    """A route's hosts in order that count how many of them are read."""

    read = 0

    def __iter__(self) -> Iterator[str]:
        for host in super().__iter__():
            self.read += 1
            yield host


def test_deepest_reads_the_hosts_holding_the_prompt_not_every_host_of_the_route():
    """On a route of a thousand hosts, two holding the prompt: the answer comes from those
    two, whatever the route's size (a lookup per host of the route made a request's cost
    grow with the fleet)."""
    index = PrefixIndex(10_000)
    chain = (1, 2, 3, 4, 5, 6)
    hosts = _Counted(f"gpu{n}" for n in range(1000))
    for host in hosts[:900]:
        index.learn(host, "m", (7, 8))  # other prompts, on most hosts
    index.learn("gpu700", "m", chain[:3])
    index.learn("gpu500", "m", chain[:3])
    places = {host: place for place, host in enumerate(hosts)}
    hosts.read = 0

    assert index.deepest(hosts, "m", chain, beyond=0, places=places) == ("gpu500", 3)
    assert index.deepest(hosts, "m", chain, beyond=3, places=places) is None
    assert hosts.read == 0


def test_deepest_forgets_a_block_the_index_evicted_or_was_told_the_host_lost():
    index = PrefixIndex(4)
    index.learn("gpu1", "m", (1, 2, 3))
    index.learn("gpu2", "m", (1, 2))  # evicts gpu1's block 3: four entries in all
    index.learn("gpu3", "m", (1, 2, 3))  # evicts gpu1's blocks 1 and 2 and gpu2's block 2
    index.correct("gpu3", "m", (1, 2, 3), 1)  # gpu3 holds block 1 alone
    hosts = ["gpu1", "gpu3", "gpu2"]

    assert index.deepest(hosts, "m", (1, 2, 3), beyond=0) == ("gpu3", 1)
    index.forget(["gpu3"])
    assert index.deepest(hosts, "m", (1, 2, 3), beyond=0) == ("gpu2", 1)
    index.forget(["gpu2"])
    assert index.deepest(hosts, "m", (1, 2, 3), beyond=0) is None
    assert len(index) == 0
