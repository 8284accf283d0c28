"""Rows the database could not take, kept on local disk until a process writes them.

A spool is a directory (the gateway's `var/spool`) of files of one JSON object per line, one
line per row. `keep` writes a new file whole (a hidden `.part` name, fsync'd, then renamed
into place), so a file under its own name is complete. `claim` takes files for this process
alone: each is renamed to `<name>.claimed-<pid>-<token>` first, and a rename is atomic, so when
several processes start at once (`CROSSBAR_WORKERS`) each file is claimed by exactly one. A
claimed file stays on disk until its rows are written (`done`); one whose claimer is gone (a
process killed while it replayed) is claimed again at the next start.

Rows carry no secret (names, times, counts, an error message), and the files are readable by
their owner only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("accounting.recorder")

_PENDING = "rows-*.jsonl"
_CLAIMED = ".claimed-"
# Names this process's claims beside its pid: a process started anew with an earlier one's
# pid (a container's first process) is not the claimer of that one's files.
_CLAIMER = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Spool:
    """The spool in `directory` (made at the first `keep`). Not thread-safe: the recorder's
    writer thread is its one user, and `waiting` may be read from any thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.waiting = 0  # rows kept or claimed by this process and not yet done

    @classmethod
    def of_database(cls, var_dir: Path, database: Mapping[str, Any]) -> Spool:
        """The spool of one database (Django's settings of a connection) in `var_dir/spool`:
        rows kept for it are written back into it only, never into another the same checkout
        is pointed at later (a test database's rows into the one `make run` serves)."""
        named = "|".join(str(database.get(key, "")) for key in ("ENGINE", "HOST", "PORT", "NAME"))
        return cls(var_dir / "spool" / hashlib.sha256(named.encode()).hexdigest()[:16])

    def keep(self, rows: Iterable[dict[str, Any]]) -> int:
        """Write `rows` to a new file of the spool, on disk when this returns; their number.

        Raises OSError (a read-only or full disk): then nothing was kept."""
        lines = [json.dumps(row, separators=(",", ":")) + "\n" for row in rows]
        if not lines:
            return 0
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"rows-{time.time_ns()}-{os.getpid()}.jsonl"
        part = self.directory / f".{name}.part"
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.writelines(lines)
                file.flush()
                os.fsync(file.fileno())
            part.rename(self.directory / name)
            _sync_directory(self.directory)
        except OSError:
            part.unlink(missing_ok=True)
            raise
        self.waiting += len(lines)
        return len(lines)

    def claim(self) -> list[Path]:
        """The files this process now holds alone: every complete file nobody claimed, and
        those whose claimer is gone. A directory that cannot be read holds none (logged)."""
        try:
            found = sorted(self.directory.glob(_PENDING)) + sorted(
                path for path in self.directory.glob(f"rows-*{_CLAIMED}*") if _abandoned(path)
            )
        except OSError as exc:
            log.error("accounting: cannot read the spool %s: %s", self.directory, exc)
            return []
        claimed = []
        for path in found:
            mine = path.with_name(f"{path.name.split(_CLAIMED)[0]}{_CLAIMED}{_CLAIMER}")
            try:
                path.rename(mine)
            except FileNotFoundError:
                continue  # another process claimed it first
            except OSError as exc:
                log.error("accounting: cannot claim %s from the spool: %s", path, exc)
                continue
            claimed.append(mine)
        return claimed

    def read(self, path: Path) -> list[dict[str, Any]]:
        """The rows of a claimed file, counted as waiting; a line that is not a JSON object
        is skipped with a warning. Raises OSError."""
        rows: list[dict[str, Any]] = []
        bad = 0
        with path.open(encoding="utf-8", errors="replace") as file:
            for line in file:
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                if isinstance(row, dict):
                    rows.append(row)
                else:
                    bad += 1
        if bad:
            log.warning("accounting: %d lines of %s are not rows; skipped", bad, path)
        self.waiting += len(rows)
        return rows

    def done(self, path: Path, rows: int) -> None:
        """The `rows` of claimed file `path` are written (or kept anew): remove it."""
        path.unlink(missing_ok=True)
        self.waiting = max(self.waiting - rows, 0)


def _abandoned(path: Path) -> bool:
    """Whether the process that claimed `path` is gone."""
    claimer = path.name.rsplit(_CLAIMED, 1)[1]
    pid, _, _ = claimer.partition("-")
    if not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return claimer != _CLAIMER
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # it exists, as another user's process
    return False


def _sync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (its entry, not only the file's data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
