"""The dashboard in a real browser: sign in, watch a request run, drain its host.

Drives Debian's chromium with Playwright (its own browser downloads are not used). The test
skips only when chromium is not installed; `.ci/run` installs it.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator

import httpx
import pytest
from django.contrib.auth.models import User

from hosts.models import Host
from tests.conftest import wait_until
from tests.fleet import MODEL, add_host, add_route, chat

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
WAIT = 15_000  # ms, for every expectation: the request runs about 6 s
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        shutil.which("chromium") is None,
        reason="chromium is not installed (apt-get install chromium; .ci/run does)",
    ),
]


@pytest.fixture
def browser_page(monkeypatch) -> Iterator[object]:  # type: ignore[no-untyped-def]
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread, which makes Django refuse ORM
    # calls from the test; the test's ORM calls are plain sync code all the same.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT)
            yield page
        finally:
            browser.close()


def test_staff_watch_a_request_run_and_drain_its_host_from_the_dashboard(
    gateway, fake, browser_page
):
    from playwright.sync_api import expect

    page = browser_page
    fake.token_delay = 0.2
    User.objects.create_superuser("ops", password="ops-password-1")
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (4, 4)})])
    gateway.sync()

    page.goto(f"{gateway.url}/dashboard/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "ops-password-1")
    page.click("input[type=submit]")
    page.wait_for_url(f"{gateway.url}/dashboard/")
    expect(page.locator("#connection")).to_have_text("live", timeout=WAIT)
    row = page.locator(f'#hosts tr[data-host="gpu1"][data-model="{MODEL}"]')
    in_flight = row.locator('[data-role="in-flight"]')
    expect(in_flight).to_have_text("0 / 4", timeout=WAIT)

    body = chat("a long answer, please", stream=True, max_tokens=30)  # about 6 s
    streaming = threading.Thread(
        target=lambda: httpx.post(
            f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=30
        )
    )
    streaming.start()
    try:
        expect(in_flight).to_have_text("1 / 4", timeout=WAIT)
        page.click('#hosts tr[data-host="gpu1"] button[data-action="drain"]')
        button = page.locator('#hosts tr[data-host="gpu1"] button')
        notices = page.locator("#notices")
        expect(row.locator('[data-role="health"]')).to_contain_text("draining", timeout=WAIT)
        expect(button).to_have_text("Stop draining", timeout=WAIT)
        expect(notices).to_contain_text("ops started draining gpu1.", timeout=WAIT)
        drained = Host.objects.get(name="gpu1").draining
        # Draining lets the running request finish; it shows among the recent requests.
        expect(in_flight).to_have_text("0 / 4", timeout=WAIT)
        finished = page.locator("#requests tbody tr").first
        expect(finished).to_contain_text("chat", timeout=WAIT)
        expect(finished).to_contain_text("200", timeout=WAIT)
    finally:
        streaming.join()

    assert drained is True
    wait_until(lambda: fake.in_flight == 0, what="the stream to end upstream")
