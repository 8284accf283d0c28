"""Time `requests_report` (and the admin's request list) over a million synthetic rows.

    .venv/bin/python bench/bench_report.py [--rows 1000000] [--database-url URL]

Without --database-url the rows go into a throwaway SQLite file in a temporary directory,
deleted afterwards. A --database-url must name a throwaway database: the bench migrates it
and fills it. Rows are shaped like real traffic: written in the order requests end, spread
over the last 23 hours (so the default `--since 24h` window holds all of them), a few percent
errors, a tenth of them without token counts.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

COLUMNS = (
    "route fingerprint model host started queued_ms ttfb_ms total_ms status streamed lease "
    "prompt_tokens cached_tokens completion_tokens error client fallback"
).split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--database-url", help="A throwaway database to fill (default: SQLite).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="crossbar-bench-") as tmp:
        os.environ["CROSSBAR_VAR_DIR"] = tmp
        os.environ["DATABASE_URL"] = args.database_url or f"sqlite:///{tmp}/bench.sqlite3"
        run(args.rows)


def run(count: int) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crossbar_site.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    print(f"database: {connection.vendor} {connection.settings_dict['NAME']}")

    started = time.perf_counter()
    insert(count)
    print(f"inserted {count:,} rows in {time.perf_counter() - started:.1f} s")
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE accounting_request")

    print(call_command("requests_report", stdout=io.StringIO()))
    for args in (
        [],
        ["--by", "host,model"],
        ["--by", "route,lease,client", "--format", "csv"],
        ["--by", "model", "--format", "json"],
    ):
        started = time.perf_counter()
        output = call_command("requests_report", *args, stdout=io.StringIO())
        elapsed = time.perf_counter() - started
        lines = output.count("\n") + 1
        print(f"requests_report {' '.join(args) or '(defaults)'}: {elapsed:.2f} s ({lines} lines)")
    time_admin()


def insert(count: int) -> None:
    from django.db import connection, transaction

    from accounting.models import Request

    table = Request._meta.db_table
    placeholders = ", ".join(["%s"] * len(COLUMNS))
    sql = f"INSERT INTO {table} ({', '.join(COLUMNS)}) VALUES ({placeholders})"
    started_field = Request._meta.get_field("started")
    rows = synthetic_rows(count, lambda moment: started_field.get_db_prep_value(moment, connection))
    with transaction.atomic(), connection.cursor() as cursor:
        batch: list[tuple[Any, ...]] = []
        for row in rows:
            batch.append(row)
            if len(batch) == 10_000:
                cursor.executemany(sql, batch)
                batch.clear()
        cursor.executemany(sql, batch)


def synthetic_rows(count: int, prepare: Callable[[datetime], Any]) -> Iterator[tuple[Any, ...]]:
    """`count` rows of `COLUMNS`' values as the database takes them (`prepare`: `started`'s)."""
    rng = random.Random(5)
    end = datetime.now(UTC)
    first = end - timedelta(hours=23)
    step = timedelta(hours=23) / count
    statuses, weights = [200, 400, 429, 499, 500, 502], [94, 1, 1, 1, 1, 2]
    leases = ["new", "reused", "reused", "reused", "moved", ""]
    for n in range(count):
        ttfb = int(rng.lognormvariate(5, 1))
        completion = rng.randint(1, 800)
        prompt = rng.randint(10, 8_000)
        total = ttfb + completion * 20
        known = rng.random() > 0.1
        # Rows are written when requests end, so `started` runs roughly, not exactly, in order.
        started = first + step * n - timedelta(milliseconds=total)
        yield (
            f"route{rng.randint(0, 5)}",
            f"{rng.getrandbits(256):064x}",
            f"model{rng.randint(0, 4)}",
            f"gpu{rng.randint(0, 7)}",
            prepare(started),
            int(rng.expovariate(0.05)) if rng.random() < 0.2 else 0,
            ttfb,
            total,
            rng.choices(statuses, weights)[0],
            rng.random() < 0.8,
            rng.choice(leases),
            prompt if known else None,
            rng.randint(0, prompt) if known else None,
            completion if known else None,
            "",
            f"client{rng.randint(0, 9)}",
            "",
        )


def time_admin() -> None:
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.test import Client

    settings.ALLOWED_HOSTS = ["*"]
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("bench", "", "bench"))
    today = datetime.now(UTC)
    for query in (
        "",
        "?route=route1",
        "?status_class=5xx&host=gpu2",
        "?q=3fa9c2",
        f"?started__year={today.year}&started__month={today.month}",
        "?p=50",
    ):
        started = time.perf_counter()
        response = client.get(f"/admin/accounting/request/{query}")
        elapsed = time.perf_counter() - started
        print(f"admin list {query or '(first page)'}: {response.status_code} in {elapsed:.2f} s")


if __name__ == "__main__":
    main()
