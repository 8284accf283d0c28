"""The spool alone: files written whole, each claimed by one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from accounting.spool import Spool


def test_kept_rows_are_in_a_file_only_its_owner_reads_one_line_each(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    assert spool.keep([{"n": 1}, {"n": 2}]) == 2

    (path,) = (tmp_path / "spool").iterdir()
    assert path.read_text() == '{"n":1}\n{"n":2}\n'
    assert path.stat().st_mode & 0o777 == 0o600
    assert spool.waiting == 2


def test_a_file_is_claimed_by_one_process_and_done_once_written(tmp_path: Path) -> None:
    Spool(tmp_path).keep([{"n": 1}])
    first, second = Spool(tmp_path), Spool(tmp_path)

    (claimed,) = first.claim()
    assert second.claim() == []
    assert first.read(claimed) == [{"n": 1}]
    assert first.waiting == 1
    first.done(claimed, 1)
    assert first.waiting == 0
    assert not list(tmp_path.iterdir())


def test_a_file_whose_claimer_is_gone_is_claimed_again_and_a_bad_line_skipped(
    tmp_path: Path,
) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (tmp_path / f"rows-1-1.jsonl.claimed-{gone}-0").write_text('{"n":1}\nnot json\n[2]\n')
    (tmp_path / f"rows-2-1.jsonl.claimed-{os.getppid()}-0").write_text('{"n":2}\n')  # alive

    (claimed,) = Spool(tmp_path).claim()
    assert Spool(tmp_path).read(claimed) == [{"n": 1}]


def test_a_file_still_being_written_is_not_claimed(tmp_path: Path) -> None:
    (tmp_path / ".rows-1-1.jsonl.part").write_text('{"n":1}\n')

    assert Spool(tmp_path).claim() == []


def test_a_file_claimed_by_an_earlier_process_with_this_ones_pid_is_claimed_again(
    tmp_path: Path,
) -> None:
    (tmp_path / f"rows-1-1.jsonl.claimed-{os.getpid()}-0").write_text('{"n":1}\n')

    (claimed,) = Spool(tmp_path).claim()
    assert Spool(tmp_path).read(claimed) == [{"n": 1}]


def test_rows_kept_for_one_database_are_never_claimed_for_another(tmp_path: Path) -> None:
    served = {"ENGINE": "django.db.backends.sqlite3", "NAME": "/srv/var/crossbar.sqlite3"}
    tested = {**served, "NAME": "/srv/var/test_crossbar_4242.sqlite3"}
    Spool.of_database(tmp_path, tested).keep([{"n": 1}])

    assert Spool.of_database(tmp_path, served).claim() == []
    assert len(Spool.of_database(tmp_path, tested).claim()) == 1
