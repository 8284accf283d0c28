"""The configuration against the hosts themselves: each host's `parallel` and its slots.

`crossbar_config check` and `load` (its dry run too) ask each host they judge for its `/props`,
all at once and each for at most `TIMEOUT` seconds, and judge what it says by
`hosts.slots.slot_fit()`: the host's `parallel` above its slots is an error (E011), below them a
warning (W002). A host that does not answer is a warning naming its URL (W003): every request
placed there would fail until it does. A host that says no slot count (router mode) is not
compared, and a note says so and why. Blocking I/O, in threads: call from a management command,
outside any transaction (a slow host must not hold the database's lock).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from hosts.describe import Described, Unreachable, read_props
from hosts.slots import ROUTER_SAYS_NO_SLOTS, slot_fit
from routing.config.validation import HostSpec, Problem, entry_key

PARALLEL_ABOVE_SLOTS = "E011"
PARALLEL_BELOW_SLOTS = "W002"
HOST_NOT_ANSWERING = "W003"

# Seconds to wait for each host (to connect, then to answer): an answer from a host on the
# network takes milliseconds, and a check must not hang on a host that is down.
TIMEOUT = 2.0
_AT_ONCE = 16


def compare_slots(
    hosts: Sequence[HostSpec], api_keys: Mapping[str, str]
) -> tuple[list[Problem], list[str]]:
    """The problems of each host's `parallel` against the slots it says it has (or of its not
    answering), and a note per host that answered without a slot count. `api_keys` holds the
    key to send each host ({name: key}), if it has one; a host's key in its problems is its
    position in `hosts` when it has no name."""
    asked = [(index, host) for index, host in enumerate(hosts) if host.url and host.models]
    if not asked:
        return [], []
    with ThreadPoolExecutor(max_workers=min(_AT_ONCE, len(asked))) as pool:
        answers = list(pool.map(lambda pair: _ask(pair[1], api_keys), asked))
    problems: list[Problem] = []
    notes: list[str] = []
    for (index, host), answer in zip(asked, answers, strict=True):
        key = entry_key("hosts", host.name, index)
        if isinstance(answer, Unreachable):
            problems.append(Problem(key, _not_answering(answer), HOST_NOT_ANSWERING))
            continue
        if isinstance(answer, str):
            notes.append(f"note: {key}: parallel not compared with the host's slots: {answer}")
            continue
        fit = slot_fit({model.name: model.parallel for model in host.models}, answer)
        if fit is None:
            continue
        where = (
            entry_key(f"{key}.models", host.models[0].name) + ".parallel"
            if len(host.models) == 1
            else f"{key}.models"
        )
        code = PARALLEL_ABOVE_SLOTS if fit.error else PARALLEL_BELOW_SLOTS
        problems.append(Problem(where, fit.message, code))
    return problems, notes


def _not_answering(failure: Unreachable) -> str:
    # The failure names the URL asked (`http://10.0.0.5:8080/props: ConnectError: ...`).
    return (
        f"the host did not answer: {failure}. Requests placed on it fail until it does; its "
        "parallel was not compared with its slots."
    )


def _ask(host: HostSpec, api_keys: Mapping[str, str]) -> int | str | Unreachable:
    """The host's slots, why there are none to compare with, or how it failed to answer."""
    try:
        described: Described = read_props(host.url, api_keys.get(host.name, ""), TIMEOUT)
    except Unreachable as exc:
        return exc
    if described.router:
        return ROUTER_SAYS_NO_SLOTS
    return described.slots or "its /props says no total_slots"
