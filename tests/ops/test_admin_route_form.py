"""The route form offers only real fallbacks and tells the operator the URL clients use."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from tests.helpers.fleet import add_host, add_route

pytestmark = pytest.mark.django_db


def fallback_choices(page: str) -> list[str]:
    select = re.search(r'<select name="fallback"[^>]*>(.*?)</select>', page, re.S)
    assert select, "the form has no fallback field"
    return re.findall(r"<option value=\"\d+\"[^>]*>([^<]+)</option>", select[1])


def test_the_fallback_choices_leave_out_the_route_itself(admin_client: Client) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080")
    chat = add_route("chat", [gpu1])
    add_route("cpu", [gpu1])
    add_route("batch", [gpu1])

    change = admin_client.get(reverse("admin:routing_route_change", args=[chat.pk]))
    add = admin_client.get(reverse("admin:routing_route_add"))

    assert fallback_choices(change.content.decode()) == ["batch", "cpu"]
    assert fallback_choices(add.content.decode()) == ["batch", "chat", "cpu"]


def test_the_change_page_shows_the_url_clients_use_as_the_request_reached_the_site(
    admin_client: Client, settings
) -> None:
    settings.ALLOWED_HOSTS = ["gateway.example.com", "testserver"]
    chat = add_route("chat", [add_host("gpu1", "http://10.0.0.5:8080")])

    page = admin_client.get(
        reverse("admin:routing_route_change", args=[chat.pk]),
        headers={"host": "gateway.example.com:8080"},
    ).content.decode()
    secure = admin_client.get(
        reverse("admin:routing_route_change", args=[chat.pk]), secure=True
    ).content.decode()

    assert "Clients use <code>http://gateway.example.com:8080/chat/v1</code>" in page
    assert "Clients use <code>https://testserver/chat/v1</code>" in secure


def test_the_list_and_the_add_page_show_the_client_url(admin_client: Client) -> None:
    add_route("chat", [add_host("gpu1", "http://10.0.0.5:8080")])

    listing = admin_client.get(reverse("admin:routing_route_changelist")).content.decode()
    add = admin_client.get(reverse("admin:routing_route_add")).content.decode()

    assert "Client URL" in listing
    assert ">http://testserver/chat/v1<" in listing
    assert "Clients will use <code>http://testserver/&lt;route&gt;/v1</code>" in add
