"""Rows per second through `Recorder.record()` into SQLite, and what one record() call costs.

    .venv/bin/python bench/bench_recorder.py [--rows 200000] [--batch-size 500]

The database is a throwaway SQLite file (WAL, as in production) in a temporary directory.
One thread records rows as fast as it can; the writer thread saves them. The backlog bound is
set to the row count so nothing is dropped: the figure is the writer's sustained rate, from
the first record() until flush() returns.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="crossbar-bench-") as tmp:
        os.environ["CROSSBAR_VAR_DIR"] = tmp
        os.environ["DATABASE_URL"] = f"sqlite:///{tmp}/bench.sqlite3"
        run(args.rows, args.batch_size)


def run(count: int, batch_size: int) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crossbar_site.settings")
    import django

    django.setup()
    from django.core.management import call_command

    from accounting.models import Request
    from accounting.recorder import Recorder, RequestRecord

    call_command("migrate", verbosity=0)
    rows = [
        RequestRecord(
            route=f"route{n % 6}",
            fingerprint=f"{n * 2654435761 % 2**256:064x}",
            model=f"model{n % 5}",
            host=f"gpu{n % 8}",
            started=datetime.now(UTC),
            queued_ms=n % 40,
            ttfb_ms=150 + n % 300,
            total_ms=4_000 + n % 9_000,
            status=200,
            streamed=True,
            lease="reused",
            prompt_tokens=2_000,
            cached_tokens=1_800,
            completion_tokens=300,
        )
        for n in range(count)
    ]
    recorder = Recorder(batch_size=batch_size, max_backlog=count)

    started = time.perf_counter()
    for row in rows:
        recorder.record(row)
    recorded = time.perf_counter() - started
    assert recorder.flush(timeout=600), "the writer did not finish"
    elapsed = time.perf_counter() - started
    recorder.stop()

    assert Request.objects.count() == count and recorder.dropped == 0
    print(f"batch size {batch_size}: {count:,} rows written in {elapsed:.1f} s")
    print(f"  sustained: {count / elapsed:,.0f} rows/s")
    print(f"  record(): {recorded / count * 1e6:.2f} µs per call, while the writer ran")


if __name__ == "__main__":
    main()
