"""A real browser for the tests that look at pages as a person does.

Debian's chromium, driven by Playwright (Playwright's own browser downloads are not used). A
test module marks itself `NEEDS_CHROMIUM`, so it skips only when chromium is not installed
(`.ci/run` installs it), and opens its pages in `chromium()`.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

NEEDS_CHROMIUM = pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="chromium is not installed (apt-get install chromium; .ci/run does)",
)


@contextmanager
def chromium(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A headless chromium, closed at the end of the block."""
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread, which makes Django refuse ORM
    # calls from the test; the test's ORM calls are plain sync code all the same.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
            # The test's ORM calls, made while Playwright's event loop runs in this thread, had
            # connections of their own (Django keys them by context then): closed here, as
            # pytest-django closes only its own, they would hold the test database open.
            connections.close_all()
