"""The host and route lists in a real browser 1366 pixels wide: every column in view, none cut.

Drives Debian's chromium with Playwright, as tests/ops/test_dashboard_browser.py does; skips
only when chromium is not installed (`.ci/run` installs it). Screenshots go to
var/test-artifacts/ (gitignored), to look at after a run.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User

from tests.helpers.browser import NEEDS_CHROMIUM
from tests.helpers.fleet import add_host, add_route
from tests.helpers.machine import ROOT

ARTIFACTS = ROOT / "var" / "test-artifacts"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    NEEDS_CHROMIUM,
]

# Long but ordinary values: quantized model file names, a cluster's host names, API keys.
MODELS = {
    "Meta-Llama-3.1-8B-Instruct-Q4_K_M": (4, 8),
    "qwen2.5-coder-32b-instruct-q5_k_m": (2, 4),
    "mistral-nemo-12b-instruct-2407-Q6_K": (1, 2),
}


def sign_in(page, gateway, then: str) -> None:
    User.objects.create_superuser("ops", password="ops-password-1")
    page.goto(f"{gateway.url}/admin/login/?next={then}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "ops-password-1")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")


# The list as a screen shows it: how far it scrolls sideways, and the columns cut at the right
# of its box or inside their own cell.
LIST_GEOMETRY = """() => {
    const box = document.querySelector('#changelist .results');
    const right = box.getBoundingClientRect().right;
    const cells = [...document.querySelectorAll('#result_list th, #result_list td')];
    return {
        overflow: box.scrollWidth - box.clientWidth,
        pageOverflow: document.documentElement.scrollWidth - window.innerWidth,
        cut: cells.filter(c => c.getBoundingClientRect().right > right + 0.5
                               || c.scrollWidth > c.clientWidth + 0.5)
                  .map(c => c.className + ': ' + c.innerText.trim().slice(0, 40)),
        heads: [...document.querySelectorAll('#result_list thead th')]
                  .map(th => th.innerText.trim().toLowerCase()),
    };
}"""


def fleet_of_long_names(gateway) -> None:
    hosts = [
        add_host(
            f"gpu-node-{n:02d}",
            f"http://gpu-node-{n:02d}.cluster.internal:8080",
            models=MODELS,
            api_key=f"sk-{n:02d}-0123456789abcdef",
            draining=n == 2,
            weight=2,
        )
        for n in (1, 2, 12)
    ]
    add_route("code-assist-nightly", hosts, default_model=next(iter(MODELS)))
    add_route("chat", hosts[:1], default_model="qwen2.5-coder-32b-instruct-q5_k_m")
    gateway.sync()


def test_the_host_list_fits_a_1366_pixel_screen_with_its_models_and_api_keys(gateway, page):
    fleet_of_long_names(gateway)

    sign_in(page, gateway, "/admin/hosts/host/")
    layout = page.evaluate(LIST_GEOMETRY)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "admin-hosts-1366.png"), full_page=True)
    draining = page.locator("#result_list .live-draining")
    colours = page.evaluate(
        """() => [...document.querySelectorAll('#result_list .live-line')]
                   .map(line => getComputedStyle(line).color)"""
    )

    assert layout["overflow"] <= 0, f"the list scrolls sideways by {layout['overflow']} px"
    assert layout["pageOverflow"] <= 0
    assert layout["cut"] == []
    assert {"models (parallel/queue)", "api key"} <= set(layout["heads"])
    assert draining.count() == 1
    drain_colour = draining.evaluate("line => getComputedStyle(line).color")
    assert colours.count(drain_colour) == 1  # a colour no other line of the column has


def test_the_route_list_fits_a_1366_pixel_screen_with_its_client_urls(gateway, page):
    fleet_of_long_names(gateway)

    sign_in(page, gateway, "/admin/routing/route/")
    layout = page.evaluate(LIST_GEOMETRY)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "admin-routes-1366.png"), full_page=True)
    urls = page.locator("#result_list td.field-client_url").all_inner_texts()

    assert layout["overflow"] <= 0, f"the list scrolls sideways by {layout['overflow']} px"
    assert layout["pageOverflow"] <= 0
    assert layout["cut"] == []
    assert sorted(urls) == [f"{gateway.url}/chat/v1", f"{gateway.url}/code-assist-nightly/v1"]
