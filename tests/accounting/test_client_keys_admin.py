"""Client keys in the admin as an operator meets them: real routes, confirmations, a key once."""

from __future__ import annotations

import io
import re
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from accounting.keys import hash_key
from accounting.models import ClientKey, Request
from routing.config import reader
from routing.core.fairness import Priority, Share
from tests.helpers.fleet import add_route

pytestmark = pytest.mark.django_db

LIST = "/admin/accounting/clientkey/"
ADD = LIST + "add/"
KEY = re.compile(r"cb-[A-Za-z0-9_-]{43}")


def form(**fields: object) -> dict[str, object]:
    """The POST of the add form, enabled, with `fields` changed."""
    return {"name": "team-a", "enabled": "on", "notes": "", **fields}


def existing_key(name: str, **fields: object) -> ClientKey:
    row = ClientKey(name=name, **fields)
    row.issue_key()
    row.save()
    return row


def add_request(client: str, age: timedelta) -> None:
    Request.objects.create(
        client=client, started=timezone.now() - age, queued_ms=0, total_ms=5, status=200
    )


def checkbox_labels(page: str) -> list[str]:
    return re.findall(r'<input type="checkbox" name="routes" value="[^"]*"[^>]*>\s*([^<]+)<', page)


def test_the_routes_are_chosen_from_the_routes_that_exist(admin_client: Client) -> None:
    add_route("code", [])
    add_route("chat", [])

    page = admin_client.get(ADD).content.decode()

    assert checkbox_labels(page) == ["chat", "code"]
    assert "None ticked: every route." in page


def test_a_key_is_saved_with_the_routes_ticked(admin_client: Client) -> None:
    add_route("chat", [])
    add_route("code", [])
    existing_key("other")  # authentication is on already: no confirmation

    response = admin_client.post(ADD, form(routes=["chat", "code"]))

    assert response.status_code == 200
    assert ClientKey.objects.get(name="team-a").route_names == ["chat", "code"]


def test_a_key_is_saved_with_its_class_and_weight_and_the_loader_carries_them(
    admin_client: Client,
) -> None:
    existing_key("other")
    page = admin_client.get(ADD).content.decode()

    saved = admin_client.post(ADD, form(priority="batch", weight="2.5"))
    refused = admin_client.post(ADD, form(name="team-z", weight="0"))

    assert "Who goes first when a host" in page and "twice the work" in page
    assert saved.status_code == 200
    row = ClientKey.objects.get(name="team-a")
    assert (row.priority, row.weight) == ("batch", 2.5)
    assert refused.status_code == 200 and not ClientKey.objects.filter(name="team-z").exists()
    spec = reader._load_clients()[row.key_hash]  # what a reload gives the runtime
    assert spec.share() == Share("team-a", Priority.BATCH, 2.5)


def test_a_key_saved_without_a_class_or_weight_is_standard_of_weight_1(
    admin_client: Client,
) -> None:
    existing_key("other")

    admin_client.post(ADD, form())

    row = ClientKey.objects.get(name="team-a")
    assert (row.priority, row.weight) == ("standard", 1.0)


def test_a_route_that_does_not_exist_is_refused_on_save(admin_client: Client) -> None:
    add_route("chat", [])
    row = existing_key("team-b", routes="chat, gone")

    page = admin_client.get(f"{LIST}{row.pk}/change/").content.decode()
    refused = admin_client.post(
        f"{LIST}{row.pk}/change/", form(name="team-b", routes=["chat", "gone"])
    )
    unticked = admin_client.post(f"{LIST}{row.pk}/change/", form(name="team-b", routes=["chat"]))

    assert checkbox_labels(page) == ["chat", "gone (no such route)"]
    assert refused.status_code == 200
    assert "Client key “team-b” names route “gone”, which does not exist." in (
        refused.content.decode()
    )
    assert unticked.status_code == 302
    assert ClientKey.objects.get(pk=row.pk).route_names == ["chat"]


def test_check_reports_a_key_naming_an_unknown_route() -> None:
    add_route("chat", [])
    existing_key("team-a", routes="chat chatt")

    with pytest.raises(CommandError) as refused:
        call_command("crossbar_config", "check", stdout=io.StringIO())

    assert (
        "error: client_keys.team-a.routes: Client key “team-a” names route “chatt”, "
        "which does not exist."
    ) in str(refused.value)


def test_the_first_enabled_key_asks_before_turning_authentication_on(
    admin_client: Client,
) -> None:
    add_route("chat", [])
    add_request("", timedelta(hours=1))
    add_request("", timedelta(hours=2))
    add_request("", timedelta(days=3))

    asked = admin_client.post(ADD, form(routes=["chat"], max_concurrent="4"))
    page = asked.content.decode()

    assert asked.status_code == 200
    assert "turns\n  authentication on for every client" in page
    assert "2 requests in the last 24 hours came without a\n  key" in page
    assert not ClientKey.objects.exists()
    assert not KEY.search(page)
    # The page carries the form on: confirming saves what was typed.
    hidden = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', page))
    assert hidden["name"] == "team-a" and hidden["_confirm_authentication"] == "yes"
    confirmed = admin_client.post(ADD, {**form(routes=["chat"], max_concurrent="4"), **hidden})
    assert confirmed.status_code == 200
    row = ClientKey.objects.get()
    assert (row.route_names, row.max_concurrent) == (["chat"], 4)


@pytest.mark.parametrize(
    "situation",
    ["another key is enabled", "the new key is disabled", "keys are required anyway"],
)
def test_no_confirmation_when_authentication_does_not_change(
    admin_client: Client, settings, situation: str
) -> None:
    fields = form()
    if situation == "another key is enabled":
        existing_key("other")
    elif situation == "the new key is disabled":
        del fields["enabled"]
    else:
        settings.CROSSBAR = {**settings.CROSSBAR, "REQUIRE_KEY": True}

    response = admin_client.post(ADD, fields)

    assert ClientKey.objects.filter(name="team-a").exists()
    assert KEY.search(response.content.decode())


def test_enabling_the_only_key_asks_first(admin_client: Client) -> None:
    row = existing_key("team-a", enabled=False)

    asked = admin_client.post(f"{LIST}{row.pk}/change/", form())

    assert "turns\n  authentication on for every client" in asked.content.decode()
    assert ClientKey.objects.get(pk=row.pk).enabled is False


def test_a_new_key_is_shown_once_in_a_read_only_field_with_a_copy_button(
    admin_client: Client,
) -> None:
    existing_key("other")

    response = admin_client.post(ADD, form())
    page = response.content.decode()

    field = re.search(r'<input id="issued-key-\d+" class="key vTextField"[^>]*>', page)
    assert field is not None
    [secret] = KEY.findall(field.group(0))
    assert "readonly" in field.group(0)
    assert "monospace" in page
    assert re.search(r'<button type="button" class="button copy-key"[^>]*>Copy</button>', page)
    assert "no-store" in response["Cache-Control"]
    row = ClientKey.objects.get(name="team-a")
    assert row.key_hash == hash_key(secret)
    for later in (LIST, f"{LIST}{row.pk}/change/"):
        assert secret not in admin_client.get(later).content.decode()


def test_replacing_keys_asks_first_then_shows_the_new_keys_once(admin_client: Client) -> None:
    first, second = existing_key("team-a"), existing_key("team-b")
    old_hashes = {first.key_hash, second.key_hash}
    selected = {"action": "replace_keys", "_selected_action": [first.pk, second.pk]}

    asked = admin_client.post(LIST, selected)
    page = asked.content.decode()

    assert asked.status_code == 200
    assert "stops working at once" in page and "Yes, replace 2 keys" in page
    assert not KEY.search(page)
    assert {row.key_hash for row in ClientKey.objects.all()} == old_hashes

    done = admin_client.post(LIST, {**selected, "post": "yes"})

    secrets = KEY.findall(done.content.decode())
    assert len(set(secrets)) == 2
    assert {row.key_hash for row in ClientKey.objects.all()} == {hash_key(s) for s in secrets}
    assert "no-store" in done["Cache-Control"]


def test_the_list_shows_when_each_key_was_last_used_and_its_requests_of_the_last_24_hours(
    admin_client: Client,
) -> None:
    existing_key("busy")
    existing_key("idle")
    existing_key("unused")
    for hours in (1, 2, 23):
        add_request("busy", timedelta(hours=hours))
    add_request("idle", timedelta(days=3))
    add_request("", timedelta(minutes=1))

    page = admin_client.get(LIST).content.decode()

    def cell(field: str) -> list[str]:
        found = re.findall(rf'<td class="field-{field}">([^<]*)</td>', page)
        return [text.strip() for text in found]

    assert "Last used" in page and "Requests (24 h)" in page
    assert cell("requests_24h") == ["3", "0", "0"]
    used = cell("last_used_at")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", used[0])
    assert used[1] < used[0] and used[2] == "never"


def test_a_key_is_saved_with_its_budgets_and_the_loader_carries_them(
    admin_client: Client,
) -> None:
    existing_key("other")
    page = admin_client.get(ADD).content.decode()

    admin_client.post(ADD, form(tokens_per_day="1000", tokens_per_month="20000"))
    row = ClientKey.objects.get(name="team-a")
    edited = admin_client.post(f"{LIST}{row.pk}/change/", form(notes="a script's edit"))
    spec = reader._load_clients()[row.key_hash]  # what a reload gives the runtime
    admin_client.post(f"{LIST}{row.pk}/change/", form(tokens_per_day="", tokens_per_month=""))

    assert "cached ones included" in page and "midnight UTC" in page
    assert edited.status_code == 302  # saved without the fields: the budgets are kept
    assert (spec.tokens_per_day, spec.tokens_per_month) == (1000, 20000)
    row.refresh_from_db()
    assert (row.tokens_per_day, row.tokens_per_month) == (None, None)


def test_the_list_shows_each_keys_tokens_of_the_utc_day_and_month_against_its_budgets(
    admin_client: Client,
) -> None:
    existing_key("busy", tokens_per_day=1000, tokens_per_month=50_000)
    existing_key("free")
    now = timezone.now()
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    month = day.replace(day=1)
    for started, prompt, completion in (
        (now, 300, 200),  # today
        (day - timedelta(seconds=1), 1000, None),  # yesterday (this month, unless the 1st)
        (month - timedelta(seconds=1), 70_000, 0),  # last month
    ):
        Request.objects.create(
            client="busy", started=started, queued_ms=0, total_ms=5, status=200,
            prompt_tokens=prompt, completion_tokens=completion,
        )  # fmt: skip

    page = admin_client.get(LIST).content.decode()
    cells = re.findall(r'<td class="field-tokens_spent">([^<]*)</td>', page)

    month_spent = "1,500" if day > month else "500"
    assert cells == [
        f"500 of 1,000 today, {month_spent} of 50,000 this month",
        "0 today, 0 this month",
    ]
