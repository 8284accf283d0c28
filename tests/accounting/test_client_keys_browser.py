"""The first client key added in a real browser: the warning, the key once, its copy button.

Drives Debian's chromium with Playwright; skips only when chromium is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from django.contrib.auth.models import User

from accounting.keys import hash_key
from accounting.models import ClientKey
from tests.helpers.browser import NEEDS_CHROMIUM, chromium
from tests.helpers.fleet import add_host, add_route, chat

pytestmark = [
    pytest.mark.django_db(transaction=True),
    NEEDS_CHROMIUM,
]


@pytest.fixture
def browser_context(gateway, monkeypatch) -> Iterator[object]:
    with chromium(monkeypatch) as browser:
        context = browser.new_context(viewport={"width": 1366, "height": 768})
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=gateway.url)
        context.set_default_timeout(15_000)
        yield context


def test_adding_the_first_key_warns_then_shows_a_key_that_copies_and_works(
    gateway, fake, browser_context
):
    User.objects.create_superuser("ops", password="ops-password-1")
    add_route("chat", [add_host("gpu1", fake.url)])
    add_route("code", [add_host("gpu2", fake.url)])
    gateway.sync()
    page = browser_context.new_page()

    page.goto(f"{gateway.url}/admin/login/?next=/admin/accounting/clientkey/add/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "ops-password-1")
    page.click("input[type=submit]")
    page.fill("#id_name", "web-frontend")
    page.check("input[name=routes][value=chat]")
    page.click("input[name=_save]")
    page.wait_for_selector("text=turns authentication on for every client")
    assert not ClientKey.objects.exists()
    page.click("input[value='Yes, turn authentication on']")
    field = page.wait_for_selector("input.key")
    page.click("button.copy-key")
    page.wait_for_selector(".copied:not([hidden])")

    shown = field.input_value()
    assert page.evaluate("navigator.clipboard.readText()") == shown
    assert field.get_attribute("readonly") is not None
    assert "monospace" in field.evaluate("f => getComputedStyle(f).fontFamily")
    row = ClientKey.objects.get()
    assert (row.key_hash, row.route_names) == (hash_key(shown), ["chat"])
    gateway.sync()
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        with_key = client.post(
            "/chat/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {shown}"}
        )
        other_route = client.post(
            "/code/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {shown}"}
        )
        without = client.post("/chat/v1/chat/completions", json=chat())
    assert (with_key.status_code, other_route.status_code, without.status_code) == (200, 403, 401)
