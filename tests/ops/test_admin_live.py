"""The host admin shows what the running gateway knows: health, slots, queues, idle drains."""

from __future__ import annotations

import re
import threading

import httpx
import pytest

from hosts.models import Host
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.conversation import (
    turns_on_a_shared_slot_taken_as_it_is,
    turns_on_an_emptying_host,
)
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import signed_in
from tests.helpers.observe import wait_for_health_poll
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_host_list_shows_health_and_requests_running(gateway, fake, admin_user):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 4)})])
    gateway.sync()
    wait_for_health_poll(fake)  # a request may reach a host before its first poll is in
    admin = signed_in(gateway)
    url = f"{gateway.url}/chat/v1/chat/completions"
    body = chat(stream=True, max_tokens=20)
    running = threading.Thread(target=lambda: httpx.post(url, json=body, timeout=30))
    running.start()
    wait_until(lambda: fake.in_flight == 1, what="the request to run")

    page = admin.get("/admin/hosts/host/").text
    running.join()

    assert "up since" in page
    assert f"{MODEL} 1/2 running, 0 queued" in page


def test_a_draining_host_shows_when_it_is_idle(gateway, fake, admin_user):
    add_route("chat", [add_host("gpu1", fake.url, draining=True)])
    gateway.sync()

    page = signed_in(gateway).get("/admin/hosts/host/").text

    assert "draining, idle" in page


def test_a_down_host_shows_why(gateway, fake, admin_user):
    fake.health = "error"
    host = add_host("gpu1", fake.url)
    add_route("chat", [host])
    gateway.sync()
    admin = signed_in(gateway)

    def change_page() -> str:
        return admin.get(f"/admin/hosts/host/{host.pk}/change/").text

    wait_until(lambda: "/health answered 500" in change_page(), what="the health poll")

    assert "down (/health answered 500) since" in change_page()


def test_the_host_list_warns_when_parallel_differs_from_the_hosts_own_slots(
    gateway, fake, admin_user
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 4)})])  # the fake has 4
    gateway.sync()
    admin = signed_in(gateway)

    page = wait_until(
        lambda: (text := admin.get("/admin/hosts/host/").text) and "host has" in text and text,
        what="a health poll that read the host's slots",
    )

    assert f"parallel 2 ({MODEL}), but the host has 4 slots" in page


def test_the_host_list_says_when_the_host_empties_its_slots_between_turns(
    gateway, fake, admin_user
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)  # its /props said its slots: conversations are told theirs
    turns_on_an_emptying_host(gateway.url, "chat", fake, "gpu1")

    page = signed_in(gateway).get("/admin/hosts/host/").text

    assert (
        f"⚠ {MODEL}: the host emptied a slot between two turns twice since it came up (a "
        "unified KV cache, or restarts not seen): llama-server chooses its slots until the "
        "host is read again" in page
    )


def test_the_host_list_says_when_the_host_gives_a_shared_slot_back_as_another_left_it(
    gateway, admin_user
):
    with FakeLlamaServer(slots=2, cache_ram=0) as fake:
        # A name of its own: the session's gateway counts each host name's since it started.
        add_route("chat", [add_host("gpu-taken-list", fake.url, models={MODEL: (2, 2)})])
        gateway.sync()
        wait_for_health_poll(fake)
        turns_on_a_shared_slot_taken_as_it_is(gateway.url, "chat", fake, "gpu-taken-list")

        page = signed_in(gateway).get("/admin/hosts/host/").text

    assert (
        f"⚠ {MODEL}: 1 turn on a shared slot got back only the part their conversations share "
        "(start llama-server with --slot-prompt-similarity 0.95)" in page
    )


def test_a_host_in_no_route_says_so_in_the_host_list(gateway, fake, admin_user):
    add_route("chat", [add_host("gpu1", fake.url)])
    add_host("spare", fake.url, shares_url=True)
    Host.objects.filter(name="gpu1").update(shares_url=True)
    gateway.sync()

    page = signed_in(gateway).get("/admin/hosts/host/").text
    rows = {name: row for name, row in re.findall(r">(gpu1|spare)</a>(.*?)</tr>", page, re.S)}

    assert "in no route" in rows["spare"]
    assert "in no route" not in rows["gpu1"]
    assert "not served by this process" not in page


def test_the_host_list_right_after_an_action_shows_what_the_action_changed(
    gateway, fake, admin_user
):
    host = add_host("gpu1", fake.url, models={MODEL: (2, 4)})  # the fake has 4 slots
    add_route("chat", [host])
    gateway.sync()
    admin = signed_in(gateway)
    token = admin.cookies["csrftoken"]

    page = admin.post(
        "/admin/hosts/host/",
        data={
            "action": "read_from_host",
            "_selected_action": [host.pk],
            "csrfmiddlewaretoken": token,
        },
        follow_redirects=True,
    ).text

    assert f"{MODEL}: 4/4" in page  # the models column, read from the database
    assert f"{MODEL} 0/4 running, 0 queued" in page  # the live column, as the gateway sees it
