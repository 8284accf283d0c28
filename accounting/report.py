"""The numbers `requests_report` prints, computed from plain rows (no database, no Django).

Every figure is computed here, in Python, from the rows the database returns, so SQLite and
PostgreSQL give the same answer to the last digit.

Definitions:

- errors: `4xx` counts 400-498, `499` (the client went away) is its own column, `5xx` 500-599.
- percentiles are nearest-rank: the p-th percentile of n sorted values is the value at rank
  ceil(p / 100 * n), so it is always a value that occurred. `ttfb` percentiles leave out rows
  that got no response head.
- `tokens` is prompt plus completion tokens (cached prompt tokens included), what client
  keys' budgets count (routing/core/budgets.py).
- token sums add the rows where the count is known; an unknown count is not a zero, and a
  group where no row knows the count has no sum (None; `-` in the table).
- `cache_hit` is cached / prompt tokens over the rows where both are known.
- `cold_turns` counts requests of a reused lease (the conversation came back to its host) that
  found less than `COLD_TURN_SHARE` of their prompt in the host's cache: the host had evicted
  the conversation's KV cache, so it needs more slots, more `--cache-ram`, or
  `--slot-prompt-similarity 0.95` (docs/config.md). Rows with unknown
  counts are not cold turns.
- `cache_lost` counts requests whose host reported fewer cached prompt blocks than the
  gateway's prefix index predicted, by more than one block (`is_cache_lost`): the host lost
  what it had been sent (evicted for other prompts, or restarted). Recurring on one host, it
  wants more slots, more `--cache-ram` or `--slot-prompt-similarity 0.95` there. Rows without
  both figures are not counted.
- `tok_per_s` is the streaming rate: completion tokens / (total_ms - ttfb_ms) in seconds, summed
  over streamed rows where the completion count and ttfb are known. A non-streamed response
  arrives whole, so it has no generation interval to measure and is left out.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from itertools import islice
from operator import itemgetter
from typing import Any

GROUPINGS = ("route", "host", "model", "lease", "placement", "patience", "code", "client")

# A reused lease that finds less than this share of its prompt cached is a cold turn.
COLD_TURN_SHARE = 0.5

# A host that reported more than this many blocks fewer than predicted lost its cache: the
# conversion from tokens to blocks is good to about one block (routing/core/prefixes.py).
CACHE_LOST_BLOCKS = 1

# The row fields summarize() reads, after the group's own fields.
ROW_FIELDS = (
    "status",
    "streamed",
    "queued_ms",
    "ttfb_ms",
    "total_ms",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "lease",
    "predicted_cached_blocks",
    "reported_cached_blocks",
)

COLUMNS = (
    "requests",
    "4xx",
    "5xx",
    "499",
    "queued_p50_ms",
    "queued_p95_ms",
    "ttfb_p50_ms",
    "ttfb_p95_ms",
    "total_p50_ms",
    "total_p95_ms",
    "tokens",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cold_turns",
    "cache_lost",
    "cache_hit",
    "tok_per_s",
)

_CHUNK = 10_000


def is_cold_turn(lease: str, prompt_tokens: int | None, cached_tokens: int | None) -> bool:
    """Whether a request came back to its conversation's host and found its cache gone."""
    return (
        lease == "reused"
        and prompt_tokens is not None
        and prompt_tokens > 0
        and cached_tokens is not None
        and cached_tokens < prompt_tokens * COLD_TURN_SHARE
    )


def is_cache_lost(predicted_blocks: int | None, reported_blocks: int | None) -> bool:
    """Whether the host held less of the prompt than the prefix index predicted, by more than
    the conversion's error; unknown figures are not a loss."""
    return (
        predicted_blocks is not None
        and reported_blocks is not None
        and predicted_blocks - reported_blocks > CACHE_LOST_BLOCKS
    )


def percentile(ordered: Sequence[int], p: float) -> int | None:
    """The nearest-rank p-th percentile of already sorted values; None when there are none."""
    if not ordered:
        return None
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def summarize(rows: Iterable[Sequence[Any]], by: Sequence[str]) -> list[dict[str, Any]]:
    """One summary per group, in group order, keyed by the `by` names and then `COLUMNS`.

    Each row is the values of the `by` fields followed by those of `ROW_FIELDS`. Rows are
    consumed in chunks and kept as columns, so a million rows cost lists of ints, not a million
    tuples; the per-row work is done by C builtins (map, zip, extend) wherever it can be.
    """
    width = len(by)
    group_of = itemgetter(*range(width))
    columns: dict[Any, list[list[Any]]] = {}
    iterator = iter(rows)
    while chunk := list(islice(iterator, _CHUNK)):
        grouped: defaultdict[Any, list[Sequence[Any]]] = defaultdict(list)
        for key, row in zip(map(group_of, chunk), chunk, strict=True):
            grouped[key].append(row)
        for key, group_rows in grouped.items():
            target = columns.setdefault(key, [[] for _ in ROW_FIELDS])
            fields = list(zip(*group_rows, strict=True))[width:]
            for column, values in zip(target, fields, strict=True):
                column.extend(values)
    return [
        {**dict(zip(by, key if width > 1 else (key,), strict=True)), **_summary(*group_columns)}
        for key, group_columns in sorted(columns.items())
    ]


def _summary(
    status: list[int],
    streamed: list[bool],
    queued: list[int],
    ttfb: list[int | None],
    total: list[int],
    prompt: list[int | None],
    cached: list[int | None],
    completion: list[int | None],
    lease: list[str],
    predicted: list[int | None],
    reported: list[int | None],
) -> dict[str, Any]:
    statuses = Counter(status)
    # The rows where both counts are known (for cache_hit), and the streamed rows with a
    # generation time (tok_per_s): (completion, ttfb, total) each.
    both_known = [
        (p, c) for p, c in zip(prompt, cached, strict=True) if p is not None and c is not None
    ]
    timed = [
        (n, h, t)
        for s, n, h, t in zip(streamed, completion, ttfb, total, strict=True)
        if s and n is not None and h is not None
    ]
    ratio_prompt = sum(p for p, _ in both_known)
    stream_ms = sum(t for _, _, t in timed) - sum(h for _, h, _ in timed)
    queued, totals = sorted(queued), sorted(total)
    heads = sorted(v for v in ttfb if v is not None)
    return {
        "requests": len(status),
        "4xx": sum(n for code, n in statuses.items() if 400 <= code < 499),
        "5xx": sum(n for code, n in statuses.items() if 500 <= code < 600),
        "499": statuses[499],
        "queued_p50_ms": percentile(queued, 50),
        "queued_p95_ms": percentile(queued, 95),
        "ttfb_p50_ms": percentile(heads, 50),
        "ttfb_p95_ms": percentile(heads, 95),
        "total_p50_ms": percentile(totals, 50),
        "total_p95_ms": percentile(totals, 95),
        "tokens": _known_sum(list(map(_spent, prompt, completion))),
        "prompt_tokens": _known_sum(prompt),
        "cached_tokens": _known_sum(cached),
        "completion_tokens": _known_sum(completion),
        "cold_turns": sum(map(is_cold_turn, lease, prompt, cached)),
        "cache_lost": sum(map(is_cache_lost, predicted, reported)),
        "cache_hit": (
            round(sum(c for _, c in both_known) / ratio_prompt, 4) if ratio_prompt else None
        ),
        "tok_per_s": (
            round(sum(n for n, _, _ in timed) * 1000 / stream_ms, 1) if stream_ms else None
        ),
    }


def _spent(prompt: int | None, completion: int | None) -> int | None:
    """A row's tokens as client keys' budgets count them; None when it knows neither count."""
    if prompt is None and completion is None:
        return None
    return (prompt or 0) + (completion or 0)


def _known_sum(counts: list[int | None]) -> int | None:
    """The sum of the known counts; None when none is known (unknown is not 0)."""
    if counts.count(None) == len(counts):
        return None
    return sum(filter(None, counts))  # skips the unknown (and zeros, which add nothing)
