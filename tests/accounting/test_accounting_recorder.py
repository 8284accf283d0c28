from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import IntegrityError, OperationalError, connection

from accounting import recorder as recorder_module
from accounting.models import Request
from accounting.recorder import Recorder, RequestRecord
from accounting.rows import spooled
from accounting.spool import Spool
from tests.helpers.database import write_lock
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)
# The route of this module's rows: the session's gateway may still be writing rows of an
# earlier test (a 503 it answered last) when these tests count theirs.
ROUTE = "recorder-test"


def make_record(n: int = 0, **overrides: object) -> RequestRecord:
    values: dict[str, Any] = {
        "route": ROUTE,
        "fingerprint": f"{n:064x}",
        "model": "qwen",
        "host": "gpu1",
        "started": datetime(2026, 11, 30, 12, 0, tzinfo=UTC),
        "queued_ms": 3,
        "ttfb_ms": 120,
        "total_ms": 900,
        "status": 200,
        "streamed": True,
        "lease": "new",
        "prompt_tokens": 100,
        "cached_tokens": 80,
        "completion_tokens": 40,
    }
    values.update(overrides)
    return RequestRecord(**values)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    recorder = Recorder(batch_size=50, flush_interval=0.05, max_backlog=1_000)
    yield recorder
    recorder.stop(timeout=5)


def mine():
    """This module's rows (`ROUTE`), whatever else the table holds."""
    return Request.objects.filter(route=ROUTE)


def test_recorded_rows_are_written_with_every_field(recorder: Recorder) -> None:
    recorder.record(make_record(1, error="upstream reset", client="team-a", fallback="backup"))
    recorder.record(
        make_record(
            2,
            ttfb_ms=None,
            prompt_tokens=None,
            cached_tokens=None,
            completion_tokens=None,
            lease="",
            status=499,
            streamed=False,
        )
    )

    assert recorder.flush()

    first, second = mine().order_by("fingerprint")
    assert first.fingerprint == f"{1:064x}"
    assert (first.route, first.model, first.host, first.lease) == (ROUTE, "qwen", "gpu1", "new")
    assert first.started == datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert (first.queued_ms, first.ttfb_ms, first.total_ms) == (3, 120, 900)
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (100, 80, 40)
    assert (first.error, first.client, first.fallback) == ("upstream reset", "team-a", "backup")
    assert second.ttfb_ms is None
    assert (second.prompt_tokens, second.cached_tokens, second.completion_tokens) == (
        None,
        None,
        None,
    )
    assert (second.status, second.streamed, second.lease) == (499, False, "")
    assert recorder.written == 2
    assert recorder.backlog == 0


def test_rows_are_found_by_the_time_they_started(recorder: Recorder) -> None:
    # Reports and the admin select rows by a window of time: a row must be stored the way
    # Django's own queries compare it.
    started = datetime(2026, 11, 30, 12, 0, 30, 250_000, tzinfo=UTC)
    recorder.record(make_record(1, started=started))
    assert recorder.flush()

    window = mine().filter(
        started__gte=datetime(2026, 11, 30, 12, 0, tzinfo=UTC),
        started__lt=datetime(2026, 11, 30, 12, 1, tzinfo=UTC),
    )
    assert [row.started for row in window] == [started]
    assert not mine().filter(started__gt=started).exists()


def test_full_batches_are_written_without_waiting_for_the_interval() -> None:
    recorder = Recorder(batch_size=10, flush_interval=60, max_backlog=1_000)
    try:
        for n in range(25):
            recorder.record(make_record(n))

        wait_until(lambda: recorder.written == 20, 5, what="two full batches")
        time.sleep(0.2)  # a window for a wrong write of the partial batch to show
        assert recorder.written == 20
        assert recorder.backlog == 5

        assert recorder.flush()
        assert mine().count() == 25
    finally:
        recorder.stop()


def test_a_partial_batch_is_written_after_the_flush_interval(recorder: Recorder) -> None:
    recorder.record(make_record(1))

    wait_until(lambda: recorder.written == 1, 5, what="the row")
    assert mine().count() == 1


def test_record_returns_at_once_while_the_database_is_locked(recorder: Recorder) -> None:
    returned = threading.Event()

    def record_all() -> None:
        for n in range(500):
            recorder.record(make_record(n))
        returned.set()

    # The lock is held until the block ends, so calls that waited for it cannot return inside
    # the block; the bound only keeps a broken recorder from hanging the test.
    with write_lock():
        threading.Thread(target=record_all, daemon=True).start()
        returned_while_locked = returned.wait(timeout=30)
        assert recorder.written == 0

    assert returned_while_locked, "record() waited for the database lock (or raised)"
    assert recorder.flush()
    assert mine().count() == 500


def test_rows_recorded_during_a_write_lock_arrive_after_it_is_released(
    recorder: Recorder,
) -> None:
    with write_lock():
        for n in range(300):
            recorder.record(make_record(n))
        time.sleep(0.5)  # ten flush intervals for the writer to try, and lose nothing

        assert recorder.written == 0
        assert recorder.backlog == 300

    assert recorder.flush()
    assert mine().count() == 300
    assert recorder.dropped == 0


def test_rows_past_the_backlog_bound_are_dropped_and_counted() -> None:
    recorder = Recorder(batch_size=50, flush_interval=0.05, max_backlog=200)
    try:
        with write_lock():
            for n in range(250):
                recorder.record(make_record(n))

            assert recorder.dropped == 50
            assert recorder.backlog == 200

        assert recorder.flush()
        written = set(mine().values_list("fingerprint", flat=True))
        assert written == {f"{n:064x}" for n in range(200)}
        assert recorder.written == 200
    finally:
        recorder.stop()


def test_dropping_is_logged_once_per_streak(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder(batch_size=50, flush_interval=0.05, max_backlog=10)
    try:
        with caplog.at_level(logging.WARNING, logger="accounting.recorder"):
            with write_lock():
                for n in range(100):
                    recorder.record(make_record(n))
            assert recorder.flush()

        drops = [r for r in caplog.records if "rows are" in r.getMessage()]
        assert [r.levelname for r in drops] == ["ERROR", "WARNING"]
        assert "new rows are dropped" in drops[0].getMessage()
        assert "accepted again; 90 were dropped" in drops[1].getMessage()
    finally:
        recorder.stop()


def test_writer_retries_with_backoff_while_the_database_is_down(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_save = recorder_module._save
    attempts: list[float] = []

    def flaky_save(rows: list[RequestRecord]) -> None:
        attempts.append(time.monotonic())
        if len(attempts) <= 4:
            raise OperationalError("connection refused")
        real_save(rows)

    monkeypatch.setattr(recorder_module, "_save", flaky_save)
    with caplog.at_level(logging.WARNING, logger="accounting.recorder"):
        for n in range(20):
            recorder.record(make_record(n))
        wait_until(lambda: recorder.failing, 5, what="the writer to fail")
        assert recorder.flush()

    assert mine().count() == 20
    assert not recorder.failing
    pauses = [later - earlier for earlier, later in zip(attempts, attempts[1:], strict=False)]
    # The lower bounds show the backoff doubling; the upper ones only that it is not far
    # longer, with the slack a thread woken late on a loaded machine needs.
    for pause, planned in zip(pauses, [0.1, 0.2, 0.4, 0.8], strict=True):
        assert planned <= pause < planned + 1.0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "cannot write to the database (OperationalError: connection refused)" in messages[0]
    assert "recovered" in messages[1]


def test_a_row_the_database_refuses_is_logged_with_why_and_its_batch_is_written(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_save = recorder_module._save

    def refusing_save(rows: list[RequestRecord]) -> None:
        if any(row.fingerprint == f"{6:064x}" for row in rows):
            raise IntegrityError("CHECK constraint failed: queued_ms")
        real_save(rows)

    monkeypatch.setattr(recorder_module, "_save", refusing_save)
    rows = [make_record(n) for n in range(10)]
    rows[6] = make_record(6, host="gpu7", error="secret-looking upstream text")

    with caplog.at_level(logging.ERROR, logger="accounting.recorder"):
        for row in rows:
            recorder.record(row)
        assert recorder.flush()

    assert mine().count() == 9
    assert not mine().filter(fingerprint=f"{6:064x}").exists()
    assert recorder.dropped == 1
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    message = caplog.records[0].getMessage()
    assert "refused a row" in message and "host=gpu7" in message and f"route={ROUTE}" in message
    assert "IntegrityError: CHECK constraint failed: queued_ms" in message
    assert "secret-looking" not in caplog.text


def test_a_figure_beyond_its_column_is_stored_empty_with_one_warning_naming_the_host(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    # The columns are PostgreSQL's integer (up to 2^31 - 1) whatever the database: SQLite
    # would take 2^31, PostgreSQL would refuse the row.
    with caplog.at_level(logging.WARNING, logger="accounting.recorder"):
        recorder.record(make_record(1, host="odd-gpu", cached_tokens=10**23 - 1))
        recorder.record(make_record(2, host="odd-gpu", completion_tokens=2**31, ttfb_ms=-5))
        recorder.record(make_record(3, completion_tokens=2**31 - 1))
        assert recorder.flush()

    assert recorder.dropped == 0
    rows = mine().order_by("fingerprint")
    assert [(r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.ttfb_ms) for r in rows] == [
        (100, None, 40, 120),
        (100, 80, None, None),
        (100, 80, 2**31 - 1, 120),
    ]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "host odd-gpu" in warnings[0] and "cached_tokens=99999999999999999999999" in warnings[0]
    assert "completion_tokens=2147483648" in warnings[1] and "ttfb_ms=-5" in warnings[1]


def test_names_longer_than_their_column_are_cut_to_fit(recorder: Recorder) -> None:
    recorder.record(make_record(1, model="m" * 500))

    assert recorder.flush()
    assert mine().get().model == "m" * 200


def test_nul_characters_a_client_sent_are_stored_as_replacement_characters(
    recorder: Recorder,
) -> None:
    recorder.record(make_record(1, model="a\x00b", error="unknown route: “ch\x00t”"))

    assert recorder.flush()
    assert recorder.dropped == 0
    row = mine().get()
    assert (row.model, row.error) == ("a\ufffdb", "unknown route: “ch\ufffdt”")


def writers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "accounting-recorder" and t.is_alive()}


def test_stop_writes_what_is_held_and_ends_the_thread() -> None:
    others = writers()  # the process recorder's, when an earlier test used it
    recorder = Recorder(batch_size=1_000, flush_interval=60)
    for n in range(30):
        recorder.record(make_record(n))
    assert writers() - others  # this recorder's writer runs

    recorder.stop()

    assert mine().count() == 30
    assert not writers() - others


def test_recording_after_stop_starts_a_new_writer(recorder: Recorder) -> None:
    recorder.record(make_record(1))
    recorder.stop()
    recorder.record(make_record(2))

    assert recorder.flush()
    assert mine().count() == 2


def test_stop_gives_up_on_a_database_that_stays_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_save(rows: list[RequestRecord]) -> None:
        raise OperationalError("database is locked")

    monkeypatch.setattr(recorder_module, "_save", broken_save)
    recorder = Recorder(batch_size=10, flush_interval=0.05)
    for n in range(25):
        recorder.record(make_record(n))

    started = time.monotonic()
    recorder.stop(timeout=0.5)

    assert time.monotonic() - started < 10  # its own half second, not the default 10 s
    assert recorder.dropped == 25
    assert recorder.backlog == 0


def test_the_process_recorder_writes_its_rows_when_the_interpreter_exits(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'exit.sqlite3'}",
        "CROSSBAR_VAR_DIR": str(tmp_path),
    }
    manage = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py")]
    shell = [*manage, "shell", "--no-imports", "-c"]
    subprocess.run([*manage, "migrate", "--verbosity", "0"], env=env, check=True)
    script = (
        "from tests.accounting.test_accounting_recorder import make_record\n"
        "from accounting.recorder import get_recorder\n"
        "assert get_recorder() is get_recorder()\n"
        "for n in range(7):\n"
        "    get_recorder().record(make_record(n))\n"
    )
    count = "from accounting.models import Request; print(Request.objects.count())"

    subprocess.run([*shell, script], env=env, check=True, cwd=settings.BASE_DIR)
    result = subprocess.run([*shell, count], env=env, check=True, capture_output=True, text=True)

    assert result.stdout.strip() == "7"


@pytest.mark.skipif(
    not (os.environ.get("CROSSBAR_PG_BIN") and os.environ.get("CROSSBAR_PG_DATA")),
    reason="needs a PostgreSQL this test may restart (CROSSBAR_PG_BIN, CROSSBAR_PG_DATA)",
)
@pytest.mark.restarts_database
def test_the_writer_reconnects_after_postgresql_restarts(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the suite runs on SQLite")
    recorder.record(make_record(1))
    assert recorder.flush()

    pg_ctl = f"{os.environ['CROSSBAR_PG_BIN']}/pg_ctl -D {os.environ['CROSSBAR_PG_DATA']}"
    # -t 300: a stop's checkpoint on two busy cores may take longer than pg_ctl's own minute.
    restart = f"{pg_ctl} -m fast -w -t 300 restart >/dev/null"
    command = ["su", "postgres", "-s", "/bin/sh", "-c", restart] if os.getuid() == 0 else restart
    subprocess.run(command, shell=os.getuid() != 0, check=True)
    for n in range(2, 12):
        recorder.record(make_record(n))

    with caplog.at_level(logging.WARNING, logger="accounting.recorder"):
        assert recorder.flush(timeout=30)
    connection.close()  # this thread's connection died with the server too
    assert mine().count() == 11
    assert recorder.dropped == 0
    assert "cannot write to the database" in caplog.text
    assert "recovered" in caplog.text


def database_down(monkeypatch: pytest.MonkeyPatch, until: threading.Event | None = None) -> None:
    """The database refuses every write (until `until` is set)."""
    real_save = recorder_module._save

    def save(rows: list[RequestRecord]) -> None:
        if until is None or not until.is_set():
            raise OperationalError("database is locked")
        real_save(rows)

    monkeypatch.setattr(recorder_module, "_save", save)


def spooled_lines(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in directory.glob("rows-*") for line in path.open()]


def test_rows_the_database_cannot_take_at_stop_are_kept_in_the_spool(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    database_down(monkeypatch)
    recorder = Recorder(batch_size=10, flush_interval=0.05, spool=Spool(tmp_path))
    for n in range(25):
        recorder.record(make_record(n))

    with caplog.at_level(logging.ERROR, logger="accounting.recorder"):
        recorder.stop(timeout=0.5)

    assert (recorder.dropped, recorder.backlog, recorder.spooled, recorder.left_at_stop) == (
        0,
        0,
        25,
        25,
    )
    lines = spooled_lines(tmp_path)
    assert sorted(line["fingerprint"] for line in lines) == [f"{n:064x}" for n in range(25)]
    assert f"25 rows kept in {tmp_path}" in caplog.text


def test_a_recorder_started_again_writes_the_spooled_rows_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    database_down(monkeypatch)
    first = Recorder(batch_size=10, flush_interval=0.05, spool=Spool(tmp_path))
    for n in range(25):
        first.record(make_record(n, started=datetime(2026, 11, 30, 12, n, tzinfo=UTC)))
    first.stop(timeout=0.2)
    monkeypatch.undo()

    # Two processes starting at once: each claims files before it writes, so one writes them.
    second, third = (
        Recorder(batch_size=10, flush_interval=0.05, spool=Spool(tmp_path)) for _ in range(2)
    )
    second.start()
    third.start()
    wait_until(lambda: second.written + third.written == 25, what="the spooled rows")
    second.stop()
    third.stop()

    rows = mine().order_by("started")
    assert [row.fingerprint for row in rows] == [f"{n:064x}" for n in range(25)]
    assert rows[3].started == datetime(2026, 11, 30, 12, 3, tzinfo=UTC)
    assert (rows[3].prompt_tokens, rows[3].cached_tokens) == (100, 80)
    assert (second.spooled, third.spooled) == (0, 0)
    assert not list(tmp_path.iterdir())


def test_spooled_rows_wait_while_the_database_is_still_down_at_the_next_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    Spool(tmp_path).keep([spooled(make_record(n)) for n in range(6)])
    back = threading.Event()
    database_down(monkeypatch, until=back)
    recorder = Recorder(batch_size=10, flush_interval=0.05, spool=Spool(tmp_path))
    recorder.start()

    wait_until(lambda: recorder.failing, what="the writer to try")
    assert recorder.spooled == 6
    back.set()
    wait_until(lambda: recorder.written == 6, what="the rows")
    assert recorder.spooled == 0
    recorder.stop()
    assert mine().count() == 6


def test_a_spool_the_disk_cannot_take_loses_the_rows_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A file where the spool's directory should be: refused even to root, as a read-only or
    # full disk refuses.
    (tmp_path / "var").write_text("")
    directory = tmp_path / "var" / "spool"
    database_down(monkeypatch)
    recorder = Recorder(batch_size=10, flush_interval=0.05, spool=Spool(directory))
    for n in range(4):
        recorder.record(make_record(n))

    with caplog.at_level(logging.ERROR, logger="accounting.recorder"):
        recorder.stop(timeout=0.2)

    assert (recorder.dropped, recorder.spooled, recorder.left_at_stop) == (4, 0, 4)
    assert f"the spool {directory} cannot take 4 rows (Not a directory): they are lost" in (
        caplog.text
    )
    assert "Traceback" not in caplog.text


def test_stop_waits_its_whole_timeout_for_the_database(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the gateway stops (atexit, uvicorn's lifespan): with the default timeout, a database
    # back within seconds gets every row; the spool is for one that stays away.
    back = threading.Event()
    database_down(monkeypatch, until=back)
    recorder = Recorder(batch_size=10, flush_interval=0.05)
    for n in range(5):
        recorder.record(make_record(n))
    wait_until(lambda: recorder.failing, what="the writer to try")
    threading.Timer(1.0, back.set).start()

    recorder.stop()

    assert (recorder.written, recorder.dropped, recorder.left_at_stop) == (5, 0, 0)
    assert mine().count() == 5
