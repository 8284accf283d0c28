"""A pytest plugin for llama.cpp's server test suite (`-p tests.e2e.llama.upstream.plugin`).

Loaded into the upstream session by `suite.py`, it changes only what this machine needs:

- `ServerPreset.load_all` (run once per session to download every preset's model) does
  nothing: the models are in the local hub already (`hub.py`, `$LLAMA_CACHE`).
- Each test's outcome is appended to `$CROSSBAR_SUITE_RESULTS` as it is known (JSON lines), so
  a run cut short still says what it saw.
- With `CROSSBAR_SUITE_MODE=crossbar`, every `ServerProcess.start()` also puts crossbar in
  front (`front.py`), then points the test at crossbar: `server_port` becomes
  `<crossbar port>/llama`, so the URLs the suite builds (`http://{host}:{port}{path}`, and the
  `base_url` of its OpenAI clients) reach `/llama/<path>`, route `llama`, with the paths
  unchanged. `stop()` gives the server its own port back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

MODE = os.environ.get("CROSSBAR_SUITE_MODE", "direct")
RESULTS = os.environ.get("CROSSBAR_SUITE_RESULTS", "")
WORK = Path(os.environ.get("CROSSBAR_SUITE_WORK") or ".")

_front: Any = None


def pytest_configure(config: pytest.Config) -> None:
    sys.path.insert(0, str(Path.cwd()))  # upstream's utils.py, as its conftest imports it
    import utils  # type: ignore[import-not-found]  # llama.cpp's, extracted at run time

    utils.ServerPreset.load_all = staticmethod(lambda: None)
    if MODE == "crossbar":
        _put_crossbar_in_front(utils.ServerProcess)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _front is not None:
        _front.close()


def _put_crossbar_in_front(process_class: Any) -> None:
    start, stop = process_class.start, process_class.stop

    def start_behind_crossbar(self: Any, *args: Any, **kwargs: Any) -> None:
        global _front
        own = getattr(self, "_own_port", None)
        if own is not None:  # started again: llama-server listens on its own port
            self.server_port = own
        start(self, *args, **kwargs)
        if self.external_server:
            return
        from tests.e2e.llama.upstream.front import ROUTE, Front

        if _front is None:  # started on first use: Django is set up in this process then
            _front = Front(WORK)
        host = self.server_host.split(",")[0].strip()
        self._own_port = self.server_port
        _front.serve(self, f"http://{host}:{self.server_port}")
        self.server_port = f"{_front.port}/{ROUTE}"

    def stop_and_forget_crossbar(self: Any) -> None:
        stop(self)
        own = getattr(self, "_own_port", None)
        if own is not None:
            self.server_port = own
            self._own_port = None

    process_class.start = start_behind_crossbar
    process_class.stop = stop_and_forget_crossbar


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not RESULTS:
        return
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
    elif report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    line = {"id": report.nodeid, "when": report.when, "outcome": report.outcome, "message": message}
    with open(RESULTS, "a") as out:
        out.write(json.dumps(line) + "\n")
