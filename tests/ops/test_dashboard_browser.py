"""The dashboard in a real browser: sign in, watch requests run, chart them, drain a host.

Drives Debian's chromium with Playwright (its own browser downloads are not used). The tests
skip only when chromium is not installed; `.ci/run` installs it. Screenshots at 1366 px go to
var/test-artifacts/ (gitignored), to look at after a run.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from accounting.models import Request
from hosts.models import Host
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.browser import NEEDS_CHROMIUM, chromium
from tests.helpers.conversation import (
    Conversation,
    turns_on_a_shared_slot_taken_as_it_is,
    turns_on_an_emptying_host,
)
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import running_gateway
from tests.helpers.machine import ROOT
from tests.helpers.observe import wait_for_health_poll
from tests.helpers.waits import wait_until

WAIT = 15_000  # ms, for every expectation: the request runs about 6 s
ARTIFACTS = ROOT / "var" / "test-artifacts"
WIDE = {"width": 1366, "height": 900}

pytestmark = [
    pytest.mark.django_db(transaction=True),
    NEEDS_CHROMIUM,
]


@pytest.fixture
def browser_page(monkeypatch) -> Iterator[object]:
    with chromium(monkeypatch) as browser:
        page = browser.new_page()
        page.set_default_timeout(WAIT)
        yield page


def sign_in(page, gateway, then: str = "/dashboard/") -> None:
    from playwright.sync_api import expect

    User.objects.create_superuser("ops", password="ops-password-1")
    page.goto(f"{gateway.url}{then}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "ops-password-1")
    page.click("input[type=submit]")
    page.wait_for_url(f"{gateway.url}{then}")
    if then == "/dashboard/":
        expect(page.locator("#connection")).to_have_text("live", timeout=WAIT)


def stream_in_thread(gateway, content: str, max_tokens: int) -> threading.Thread:
    body = chat(content, stream=True, max_tokens=max_tokens)
    thread = threading.Thread(
        target=lambda: httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=60)
    )
    thread.start()
    return thread


def test_staff_watch_a_request_run_and_drain_its_host_from_the_dashboard(
    gateway, fake, browser_page
):
    from playwright.sync_api import expect

    page = browser_page
    fake.token_delay = 0.2
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (4, 4)})])
    gateway.sync()

    sign_in(page, gateway)
    card = page.locator('#hosts [data-host="gpu1"]')
    in_flight = card.locator(f'tr[data-model="{MODEL}"] [data-role="in-flight"]')
    expect(in_flight).to_have_text("0 / 4 running", timeout=WAIT)

    asked: list[str] = []

    def answer(dialog: Any) -> None:  # gpu1 is the route's last host: the page asks first
        asked.append(dialog.message)
        dialog.accept()

    page.on("dialog", answer)
    streaming = stream_in_thread(gateway, "a long answer, please", 30)  # about 6 s
    try:
        expect(in_flight).to_have_text("1 / 4 running", timeout=WAIT)
        card.locator('button[data-action="drain"]').click()
        notices = page.locator("#notices")
        expect(card.locator('[data-role="health"]')).to_contain_text("draining", timeout=WAIT)
        expect(card.locator("button")).to_have_text("Stop draining", timeout=WAIT)
        expect(notices).to_contain_text("ops started draining gpu1.", timeout=WAIT)
        drained = Host.objects.get(name="gpu1").draining
        # Draining lets the running request finish; it shows among the recent requests.
        expect(in_flight).to_have_text("0 / 4 running", timeout=WAIT)
        finished = page.locator("#requests tbody tr").first
        expect(finished).to_contain_text("chat", timeout=WAIT)
        expect(finished).to_contain_text("200", timeout=WAIT)
    finally:
        streaming.join()

    assert drained is True
    assert len(asked) == 1 and "Route “chat”" in asked[0] and "Drain gpu1 anyway?" in asked[0]
    wait_until(lambda: fake.in_flight == 0, what="the stream to end upstream")


def successes(page) -> int:
    """The 2xx count the requests chart gives for its window, as the page shows it."""
    summary = page.locator('[data-chart="requests"] .latest').inner_text()
    found = re.search(r"2xx (\d+)", summary)
    assert found, f"no 2xx count in the summary: {summary!r}"
    return int(found.group(1))


@pytest.fixture
def fresh_gateway(transactional_db, tmp_path):
    """A gateway of the test's own: its history holds only this test's requests. It starts
    its history from the rows it finds, and an earlier test's gateway may still write its last
    ones after that test's end (its recorder writes every half second): those go first."""
    time.sleep(1.0)
    Request.objects.all().delete()
    with running_gateway(tmp_path) as gw:
        yield gw


def test_running_streams_show_in_the_running_table_and_the_charts(
    fresh_gateway, fake, fake2, browser_page
):
    from playwright.sync_api import expect

    gateway = fresh_gateway
    page = browser_page
    page.set_viewport_size(WIDE)
    fake.token_delay = fake2.token_delay = 0.2
    # This test's rows only, in the admin below: an earlier test's last row may land late.
    since = urlencode({"started__gte": timezone.now().isoformat()})
    add_route(
        "chat",
        [
            add_host("gpu-a", fake.url, models={MODEL: (2, 4)}),
            add_host("gpu-b", fake2.url, models={MODEL: (2, 4)}),
        ],
    )
    gateway.sync()
    sign_in(page, gateway)
    requests = page.locator('[data-chart="requests"]')
    expect(requests.locator(".latest")).to_contain_text("in this window: 2xx 0", timeout=WAIT)

    streams = [stream_in_thread(gateway, f"conversation {i}, tell me more", 30) for i in range(3)]
    try:
        running = page.locator("#running tbody tr[data-route='chat']")
        expect(running).to_have_count(3, timeout=WAIT)
        expect(page.locator("#running-count")).to_have_text("(3)", timeout=WAIT)
        # Tokens so far grow while the streams run (one per event relayed).
        expect(running.first.locator('[data-role="tokens"]')).not_to_have_text("0", timeout=WAIT)
        expect(running.first).to_contain_text("gpu-", timeout=WAIT)
        in_flight = page.locator('[data-chart="in_flight"] .latest')
        busy = re.compile(r"latest: .*gpu-[ab] (0\.\d*[1-9]|[1-9])")
        expect(in_flight).to_have_text(busy, timeout=WAIT)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-running.png"), full_page=True)
    finally:
        for stream in streams:
            stream.join()

    expect(requests.locator(".latest")).to_contain_text("2xx 3 ", timeout=WAIT)
    expect(page.locator('[data-chart="tokens"] .latest')).to_have_text(
        re.compile(r"in this window: [1-9]\d* tokens"), timeout=WAIT
    )
    expect(page.locator('[data-chart="ttfb"] .latest')).to_have_text(
        re.compile(r"latest: p50 \d"), timeout=WAIT
    )
    expect(page.locator("#running tbody")).to_contain_text("Nothing running.", timeout=WAIT)
    expect(requests.locator("canvas")).to_have_count(1)
    assert int(requests.get_attribute("data-points") or 0) == 60
    # The three requests, spread over the two hosts, in the hosts' cards.
    counts = page.locator('#hosts [data-figure="requests"]')
    expect(counts).to_have_count(2)
    expect(counts.nth(0)).not_to_have_text("0", timeout=WAIT)
    expect(counts.nth(1)).not_to_have_text("0", timeout=WAIT)
    assert sum(int(text) for text in counts.all_inner_texts()) == 3

    page.click('#windows button[data-window="1h"]')
    expect(page.locator("#window-note")).to_contain_text("steps of 30 s", timeout=WAIT)
    assert int(requests.get_attribute("data-points") or 0) == 120
    assert successes(page) == 3
    page.click('#windows button[data-window="5m"]')
    expect(page.locator("#window-note")).to_contain_text("steps of 5 s", timeout=WAIT)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    page.goto(f"{gateway.url}/admin/hosts/host/")
    expect(page.locator("#result_list")).to_contain_text("gpu-b", timeout=WAIT)
    page.screenshot(path=str(ARTIFACTS / "admin-hosts.png"), full_page=True)
    page.goto(f"{gateway.url}/admin/accounting/request/?{since}")
    rows = page.locator("#result_list tbody tr", has_text=MODEL)
    expect(rows).to_have_count(3, timeout=WAIT)
    page.screenshot(path=str(ARTIFACTS / "admin-requests.png"), full_page=True)


# -- the page as a screen shows it, after a restart -------------------------------------------

SCREENS = {"1366": {"width": 1366, "height": 768}, "1920": {"width": 1920, "height": 1080}}
CODES = [
    ("queue_full", 503), ("upstream_timeout", 504), ("upstream_unreachable", 502),
    ("no_healthy_host", 503), ("rate_limit_exceeded", 429), ("model_not_found", 404),
    ("pinned_host_down", 503), ("bad_request", 400),
]  # fmt: skip
TTFBS_MS = [80, 400, 2_500, 15_000]


def add_rows_before_the_start(count: int) -> None:
    """`count` finished requests between 50 and 6 minutes ago: an hour's, not 5 minutes'; a
    third of them errors of eight codes, TTFBs up to 15 s."""
    now = timezone.now()
    span = timedelta(minutes=44) / count
    rows = []
    for i in range(count):
        code, status = CODES[i // 3 % len(CODES)] if i % 3 == 0 else ("", 200)
        rows.append(
            Request(
                route="chat",
                model=MODEL,
                host=("gpu-a", "gpu-b")[i % 2],
                started=now - timedelta(minutes=50) + i * span,
                queued_ms=0,
                ttfb_ms=TTFBS_MS[i % len(TTFBS_MS)],
                total_ms=20_000,
                status=status,
                code=code,
                streamed=True,
                lease="new",
                prompt_tokens=100,
                cached_tokens=0,
                completion_tokens=30,
            )  # fmt: skip
        )
    Request.objects.bulk_create(rows)


def window_total(page) -> int:
    """Every request the requests chart counts in its window, as its summary line says."""
    summary = page.locator('[data-chart="requests"] .latest').inner_text()
    return sum(int(n) for n in re.findall(r"(?:2xx|4xx|5xx|499) (\d+)", summary))


def choose_window(page, name: str, note: str) -> None:
    from playwright.sync_api import expect

    page.click(f'#windows button[data-window="{name}"]')
    expect(page.locator("#window-note")).to_contain_text(note, timeout=WAIT)


# What a reader sees of the charts: labels cut at the canvas' left edge (ink in its first
# columns: the value axis draws its labels right-aligned against the plot), legends running
# into another chart, and where the first chart starts.
CHART_GEOMETRY = """() => {
    const overlaps = (a, b) => a.left < b.right && b.left < a.right
                              && a.top < b.bottom && b.top < a.bottom;
    const charts = [...document.querySelectorAll('#charts .chart')];
    const cut = [], crossed = [];
    for (const chart of charts) {
        const canvas = chart.querySelector('canvas');
        const ink = canvas.getContext('2d').getImageData(0, 0, 2, canvas.height).data;
        if (ink.some((value, i) => i % 4 === 3 && value > 0)) cut.push(chart.dataset.chart);
        const legend = chart.querySelector('.u-legend').getBoundingClientRect();
        for (const other of charts) {
            if (other === chart) continue;
            for (const part of [other.querySelector('h3'), other.querySelector('canvas')]) {
                if (overlaps(legend, part.getBoundingClientRect()))
                    crossed.push(chart.dataset.chart + ' over ' + other.dataset.chart);
            }
        }
    }
    return {
        cut, crossed,
        labels: Object.fromEntries(charts.map(c => [c.dataset.chart, c.dataset.valueLabels])),
        firstChartBottom: charts[0].querySelector('canvas').getBoundingClientRect().bottom,
        pageOverflow: document.documentElement.scrollWidth - window.innerWidth,
    };
}"""


@pytest.fixture
def rows_then_gateway(django_db_setup, tmp_path):
    """Rows of requests an earlier gateway served, then a gateway started after them."""
    add_rows_before_the_start(60)
    with running_gateway(tmp_path) as gw:
        yield gw


def test_after_a_restart_the_page_shows_the_hours_requests_and_fits_1366_and_1920_pixels(
    rows_then_gateway, fake, fake2, browser_page
):
    from playwright.sync_api import expect

    gateway, page = rows_then_gateway, browser_page
    fake.token_delay = fake2.token_delay = 0.2
    add_route(
        "chat",
        [
            add_host("gpu-a", fake.url, models={MODEL: (4, 4)}),
            add_host("gpu-b", fake2.url, models={MODEL: (4, 4)}),
        ],
    )
    gateway.sync()
    page.set_viewport_size(SCREENS["1366"])
    sign_in(page, gateway)
    choose_window(page, "1h", "steps of 30 s")
    # The hour's rows, counted although this gateway served none of them.
    expect(page.locator('[data-chart="requests"] .latest')).to_contain_text("2xx 40 ", timeout=WAIT)
    assert window_total(page) == 60
    expect(page.locator('[data-chart="codes"] .latest')).to_contain_text("queue_full", timeout=WAIT)

    streams = [stream_in_thread(gateway, f"conversation {i}, tell me more", 30) for i in range(8)]
    try:
        running = page.locator("#running tbody tr[data-route='chat']")
        toggle = page.locator("#running-toggle")
        expect(page.locator("#running-count")).to_have_text("(8)", timeout=WAIT)
        expect(running).to_have_count(5)  # folded past five rows
        expect(toggle).to_have_text("Show all 8")
        screens = {}
        for name, size in SCREENS.items():
            page.set_viewport_size(size)
            page.wait_for_function(
                "document.querySelector('#charts canvas').width"
                " === Math.max(300, document.querySelector('#charts .plot').clientWidth)"
            )
            screens[name] = page.evaluate(CHART_GEOMETRY)
            page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"))
            page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}-full.png"), full_page=True)
        toggle.click()
        expect(running).to_have_count(8)
        expect(toggle).to_have_text("Show the first 5")
    finally:
        for stream in streams:
            stream.join()

    expect(page.locator("#running tbody")).to_contain_text("Nothing running.", timeout=WAIT)
    expect(page.locator("#running-more")).to_be_hidden()
    for name, geometry in screens.items():
        assert geometry["cut"] == [], f"{name} px: labels cut at the left of {geometry['cut']}"
        assert geometry["crossed"] == [], f"{name} px: {geometry['crossed']}"
        assert geometry["pageOverflow"] <= 0, f"{name} px: the page scrolls sideways"
        # History above the fold: the first chart whole in the first screen.
        assert geometry["firstChartBottom"] <= SCREENS[name]["height"], name
        assert "15,000" in geometry["labels"]["ttfb"], geometry["labels"]["ttfb"]
    # A shorter window never counts more than a longer one.
    expect(page.locator('[data-chart="requests"] .latest')).to_contain_text("2xx 48 ", timeout=WAIT)
    hour = window_total(page)
    choose_window(page, "5m", "steps of 5 s")
    five = window_total(page)
    choose_window(page, "24h", "per minute")
    expect(page.locator('[data-chart="requests"] .latest')).to_contain_text("2xx 48 ", timeout=WAIT)
    day = window_total(page)
    assert (five, hour, day) == (8, 68, 68)
    # One time zone and format: the site's, 24 hours with seconds.
    expect(page.locator("#time-zone")).to_have_text("times in UTC")
    started = page.locator("#requests tbody tr").first.locator("td").first.inner_text()
    assert re.fullmatch(r"\d\d:\d\d:\d\d", started), started
    moment = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    since = page.locator('#hosts [data-host="gpu-a"] [data-role="since"]').inner_text()
    assert re.fullmatch(rf"up since {moment} \(this gateway's view\)", since), since
    started = page.locator("#gateway-since").inner_text()
    assert re.fullmatch(rf"gateway started {moment}", started), started


# -- a host that keeps losing its cache ------------------------------------------------------


# What a reader sees of a host's card, read at once (the cards are drawn again every tick):
# whether its hint wraps inside it, and whether its two counts of a lost cache share a line.
CARD_GEOMETRY = """(host) => {
    const card = document.querySelector(`#hosts [data-host="${host}"]`);
    const box = (selector) => card.querySelector(selector).getBoundingClientRect();
    const outer = card.getBoundingClientRect();
    const hint = box('[data-role="cache-lost-hint"]');
    return {
        hintInside: outer.left <= hint.left && hint.right <= outer.right
                    && hint.bottom <= outer.bottom,
        sameLine: box('[data-figure="cold turns"]').top === box('[data-figure="cache lost"]').top,
        pageOverflow: document.documentElement.scrollWidth - window.innerWidth,
    };
}"""


def test_a_host_that_keeps_losing_its_cache_says_so_on_its_card_at_1366_and_1920_pixels(
    gateway, fake, browser_page
):
    from playwright.sync_api import expect

    page = browser_page
    # A name of its own: the session's gateway keeps each host name's last 5 minutes.
    add_route("chat", [add_host("gpu-forgetful", fake.url)])
    gateway.sync()
    conversation = Conversation(f"{gateway.url}/chat/v1/chat/completions")
    conversation.turn()
    for _ in range(2):  # the host loses what the prefix index expected it to hold, twice
        fake.forget_cache()
        conversation.turn()

    page.set_viewport_size(SCREENS["1366"])
    sign_in(page, gateway)
    card = page.locator('#hosts [data-host="gpu-forgetful"]')
    expect(card.locator('[data-figure="cache lost"]')).to_have_text("2", timeout=WAIT)
    hint = card.locator('[data-role="cache-lost-hint"]')
    expect(hint).to_contain_text("Lost what it had cached 2 times in 5 minutes:")
    expect(hint).to_contain_text("--parallel")
    lost_chart = page.locator('[data-chart="cache_lost"] .latest')
    expect(lost_chart).to_have_text("in this window: gpu-forgetful 2", timeout=WAIT)
    for name, size in SCREENS.items():
        page.set_viewport_size(size)
        page.screenshot(path=str(ARTIFACTS / f"dashboard-cache-lost-{name}.png"))
        geometry = page.evaluate(CARD_GEOMETRY, "gpu-forgetful")

        assert geometry["hintInside"], f"{name} px: the hint runs out of its card"
        assert geometry["sameLine"], f"{name} px: cold turns and cache lost on two lines"
        assert geometry["pageOverflow"] <= 0, f"{name} px: the page scrolls sideways"


def test_a_host_that_empties_its_slots_between_turns_says_so_on_its_card(
    gateway, fake, browser_page
):
    from playwright.sync_api import expect

    page = browser_page
    add_route("chat", [add_host("gpu-unified", fake.url)])
    gateway.sync()
    wait_for_health_poll(fake)  # its /props said its slots: conversations are told theirs
    turns_on_an_emptying_host(gateway.url, "chat", fake, "gpu-unified")

    sign_in(page, gateway)
    hint = page.locator('#hosts [data-host="gpu-unified"] [data-role="slots-chosen-hint"]')

    expect(hint).to_contain_text(
        f"{MODEL}: the host emptied a conversation's slot between turns", timeout=WAIT
    )
    expect(hint).to_contain_text("-np")


def test_a_host_that_gives_a_shared_slot_back_as_another_left_it_says_so_on_its_card(
    gateway, browser_page
):
    from playwright.sync_api import expect

    page = browser_page
    with FakeLlamaServer(slots=2, cache_ram=0) as fake:
        # A name of its own: the session's gateway counts each host name's since it started.
        add_route("chat", [add_host("gpu-taken-card", fake.url, models={MODEL: (2, 2)})])
        gateway.sync()
        wait_for_health_poll(fake)
        turns_on_a_shared_slot_taken_as_it_is(gateway.url, "chat", fake, "gpu-taken-card")

        sign_in(page, gateway)
        hint = page.locator(
            '#hosts [data-host="gpu-taken-card"] [data-role="shared-slot-lost-hint"]'
        )

        expect(hint).to_contain_text(
            f"{MODEL}: 1 turn on a slot another conversation used last got back only what the "
            "two share",
            timeout=WAIT,
        )
        expect(hint).to_contain_text("--slot-prompt-similarity 0.95")


# The longest horizontal run of one colour on a chart's canvas: a dot is a few pixels wide, a
# line drawn from one step to another far from it hundreds.
LONGEST_RUN = """([chart, color]) => {
    const canvas = document.querySelector(`[data-chart="${chart}"] canvas`);
    const {width, height} = canvas;
    const data = canvas.getContext('2d').getImageData(0, 0, width, height).data;
    const [r, g, b] = [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16));
    let longest = 0;
    for (let y = 0; y < height; y++) {
        let run = 0;
        for (let x = 0; x < width; x++) {
            const i = (y * width + x) * 4;
            const off = Math.abs(data[i] - r) + Math.abs(data[i + 1] - g)
                        + Math.abs(data[i + 2] - b);
            run = off < 60 && data[i + 3] > 50 ? run + 1 : 0;
            longest = Math.max(longest, run);
        }
    }
    return longest;
}"""


@pytest.fixture
def two_far_rows_then_gateway(django_db_setup, tmp_path):
    """Two requests 40 minutes apart with one TTFB, served before this gateway started."""
    now = timezone.now()
    Request.objects.bulk_create(
        Request(route="chat", model=MODEL, host="gpu-a", started=now - timedelta(minutes=minutes),
                queued_ms=0, ttfb_ms=400, total_ms=1_000, status=200, streamed=True)
        for minutes in (50, 10)
    )  # fmt: skip
    with running_gateway(tmp_path) as gw:
        yield gw


def test_the_dashboard_labels_errors_lists_requests_by_finish_and_draws_no_line_over_no_data(
    two_far_rows_then_gateway, fake, browser_page
):
    from playwright.sync_api import expect

    gateway, page = two_far_rows_then_gateway, browser_page
    fake.token_delay = 0.5  # seconds between its start and its finish
    add_route("chat", [add_host("gpu-a", fake.url)])
    gateway.sync()
    page.set_viewport_size(SCREENS["1366"])
    sign_in(page, gateway)
    choose_window(page, "1h", "steps of 30 s")
    expect(page.locator('[data-chart="ttfb"] .latest')).not_to_contain_text("no data", timeout=WAIT)

    body = chat(stream=True, max_tokens=6)
    assert httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=30).is_success
    row = wait_until(
        lambda: Request.objects.filter(started__gte=timezone.now() - timedelta(minutes=1)).first(),
        what="the request's row",
    )
    finished = row.started + timedelta(milliseconds=row.total_ms)
    assert f"{finished:%H:%M:%S}" != f"{row.started:%H:%M:%S}"
    first_row = page.locator("#requests tbody tr").first
    expect(first_row.locator("td").first).to_have_text(f"{finished:%H:%M:%S}", timeout=WAIT)
    card = page.locator('#hosts [data-host="gpu-a"]')
    expect(card.locator("dt", has_text="errors")).to_have_text("errors 4xx·5xx·499")
    overflow = page.evaluate(
        """(card) => Math.max(...[...card.querySelectorAll('dd')].map(
            (dd) => dd.getBoundingClientRect().right - card.getBoundingClientRect().right))""",
        card.element_handle(),
    )

    assert page.locator("#requests thead th").first.text_content() == "Finished"
    # The two TTFB dots, 40 minutes apart, with no line between them.
    assert page.evaluate(LONGEST_RUN, ["ttfb", "#2b6cb0"]) < 20  # p50
    assert page.evaluate(LONGEST_RUN, ["ttfb", "#c05621"]) < 20  # p95, drawn over it
    assert overflow <= 0, "a figure runs past the host's card"
