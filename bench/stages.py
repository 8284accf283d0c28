"""Where a request's first token waits: the `+stages` lever's timestamps, stage by stage.

A target with `+stages` (bench/levers/sitecustomize.py) writes, at exit, one JSON line per
request it served: the `time.perf_counter()` at each stage of the way to the first token
(the lever's docstring lists them). The load generator's samples carry the client's port and
when the request was sent on the same clock, so each sample is matched with the server's
record of the same request (same client port, the first record after the send), and its time
to first token is cut into the intervals between consecutive stages, from the client's send
to its first SSE event:

    in        client sends -> the server calls the application (parsing, the loop's queue)
    ...       one interval per stage the request passed (a floor has no view, no placement)
    out       the server's `send` of the first chunk returns -> the client reads it (the
              server's write, the kernel, the load generator's loop)

The intervals of one request add up to its TTFB exactly, so their means add up to the mean
TTFB; their medians do not add up, but say which intervals are slow most of the time.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

# The stages in the order a request passes them (a floor skips `view` and `placed`).
ORDER = (
    "app", "body", "view", "placed", "upstream_send", "connected", "request_sent",
    "upstream_head", "client_head", "upstream_first", "client_first", "client_first_out",
)  # fmt: skip
# What each interval ending at a stage is, for the table.
ENDING_AT = {
    "app": "in: client sent -> application called",
    "body": "body received",
    "view": "Django request, URLconf -> view",
    "placed": "view -> placed (route, access, body, slot)",
    "upstream_send": "-> upstream request built, send called",
    "connected": "-> connected to the host",
    "request_sent": "-> request head written",
    "upstream_head": "-> host's response head",
    "client_head": "-> response start sent to the server",
    "upstream_first": "-> host's first chunk read",
    "client_first": "-> first chunk handed to the server",
    "client_first_out": "the server's send returns",
    "out": "out: -> client reads the first event",
}


def read_records(path: Path) -> dict[int, list[dict[str, float]]]:
    """The lever's records by client port, each port's sorted by arrival."""
    by_port: dict[int, list[dict[str, float]]] = {}
    if not path.exists():
        return by_port
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_port.setdefault(int(record["port"]), []).append(record)
    for records in by_port.values():
        records.sort(key=lambda record: record["app"])
    return by_port


def intervals(sample: dict, by_port: dict[int, list[dict[str, float]]]) -> dict[str, float] | None:
    """The sample's TTFB cut into intervals (ms, keyed by the stage each ends at, and `out`),
    or None when the server has no record of it."""
    records = by_port.get(sample.get("port", 0))
    if not records or sample["status"] != 200 or sample["error"]:
        return None
    sent = sample["sent_at"]
    index = bisect.bisect_left([record["app"] for record in records], sent)
    if index == len(records):
        return None
    record = records[index]
    first_event = sent + sample["ttfb_ms"] / 1000
    if record["app"] > first_event or "client_first_out" not in record:
        return None
    cut: dict[str, float] = {}
    before = sent
    for stage in ORDER:
        if stage in record:
            cut[stage] = (record[stage] - before) * 1000
            before = record[stage]
    cut["out"] = (first_event - before) * 1000
    return cut


def summary(samples: list[dict], by_port: dict[int, list[dict[str, float]]]) -> dict:
    """p50 and mean of each interval over the samples found among the server's records."""
    found = [cut for sample in samples if (cut := intervals(sample, by_port)) is not None]
    stages = [stage for stage in (*ORDER, "out") if any(stage in cut for cut in found)]
    table = {}
    for stage in stages:
        values = sorted(cut[stage] for cut in found if stage in cut)
        table[stage] = {"p50_ms": values[len(values) // 2], "mean_ms": sum(values) / len(values)}
    ttfb = sorted(sum(cut.values()) for cut in found)
    return {
        "requests": len(samples),
        "matched": len(found),
        "ttfb_p50_ms": ttfb[len(ttfb) // 2] if ttfb else math.nan,
        "ttfb_mean_ms": sum(ttfb) / len(ttfb) if ttfb else math.nan,
        "intervals": table,
    }


def print_stages(reports: dict[str, dict]) -> None:
    """One table per concurrency: each `+stages` target's intervals side by side."""
    labels = [label for label, report in reports.items() if "stages" in report]
    if not labels:
        return
    width = max(16, *(len(label) + 2 for label in labels))
    concurrencies = sorted({c for label in labels for c in reports[label]["stages"]})
    for concurrency in concurrencies:
        print(f"\nwhere the first token waits at concurrency {concurrency}: ms, p50 / mean")
        print(f"{'':<46}" + "".join(f"{label:>{width}}" for label in labels))
        rows = dict.fromkeys(
            stage for label in labels
            for stage in reports[label]["stages"].get(concurrency, {}).get("intervals", {})
        )  # fmt: skip
        for stage in sorted(rows, key=lambda stage: (*ORDER, "out").index(stage)):
            cells = []
            for label in labels:
                found = reports[label]["stages"].get(concurrency, {}).get("intervals", {})
                cell = found.get(stage)
                cells.append(f"{cell['p50_ms']:.2f} / {cell['mean_ms']:.2f}" if cell else "")
            print(f"{ENDING_AT[stage]:<46}" + "".join(f"{cell:>{width}}" for cell in cells))
        cells = []
        for label in labels:
            found = reports[label]["stages"].get(concurrency, {})
            cells.append(f"{found.get('ttfb_p50_ms', math.nan):.2f} /"
                         f" {found.get('ttfb_mean_ms', math.nan):.2f}")  # fmt: skip
        print(f"{'TTFB (matched requests)':<46}" + "".join(f"{cell:>{width}}" for cell in cells))
        cells = [
            f"{found.get('matched', 0)} of {found.get('requests', 0)}"
            for label in labels
            for found in [reports[label]["stages"].get(concurrency, {})]
        ]
        print(f"{'requests matched':<46}" + "".join(f"{cell:>{width}}" for cell in cells))
