"""The admin's labels read as an operator writes them: URL, TTL, TTFB, and units in brackets."""

from __future__ import annotations

import re

import pytest
from django.apps import apps
from django.test import Client
from django.utils.text import capfirst

pytestmark = pytest.mark.django_db

# Django capitalises the first letter of a field's name: "url" becomes "Url".
MISSPELT = re.compile(r"\b(Url|Ttl|Ttfb|Api|Cors|Sha256)\b|(?<!\()\bms\b")


def labels(page: str) -> list[str]:
    found = re.findall(r"<label[^>]*>(.*?)</label>", page, re.S)
    return [re.sub(r"<[^>]+>|:", "", label).strip() for label in found]


def test_no_field_of_the_admin_spells_an_acronym_or_a_unit_as_a_plain_word() -> None:
    names = [
        str(capfirst(field.verbose_name))
        for app in ("hosts", "routing", "accounting")
        for model in apps.get_app_config(app).get_models()
        for field in model._meta.concrete_fields
    ]

    assert [name for name in names if MISSPELT.search(name)] == []


def test_the_host_and_route_forms_say_url_and_lease_ttl(admin_client: Client) -> None:
    host_form = labels(admin_client.get("/admin/hosts/host/add/").content.decode())
    route_form = labels(admin_client.get("/admin/routing/route/add/").content.decode())

    assert "URL" in host_form and "Url" not in host_form
    assert "Lease TTL" in route_form and "Lease ttl" not in route_form
    assert "CORS origins" in route_form
