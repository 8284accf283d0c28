"""One time zone and one format for every time an operator reads: the site's, to the second."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.test import Client

from hosts.models import Host
from tests.helpers.request_rows import LIST, add

pytestmark = pytest.mark.django_db

MOMENT = datetime(2026, 11, 30, 8, 13, 5, tzinfo=UTC)


def test_the_request_list_and_the_dashboard_use_the_sites_zone(
    admin_client: Client, settings
) -> None:
    settings.TIME_ZONE = "Europe/Berlin"
    add(started=MOMENT)

    listing = admin_client.get(LIST).content.decode()
    page = admin_client.get("/dashboard/").content.decode()

    assert "2026-11-30 09:13:05" in listing  # UTC+1 in November
    assert 'data-time-zone="Europe/Berlin"' in page
    assert "times in Europe/Berlin" in page


def test_the_admins_own_pages_write_times_as_the_request_list_does(
    admin_client: Client, admin_user
) -> None:
    host = Host.objects.create(name="gpu1", url="http://10.0.0.5:8080")
    LogEntry.objects.create(
        user=admin_user, content_type=ContentType.objects.get_for_model(Host),
        object_id=str(host.pk), object_repr="gpu1", action_flag=CHANGE, action_time=MOMENT,
        change_message="Changed weight.",
    )  # fmt: skip

    history = admin_client.get(f"/admin/hosts/host/{host.pk}/history/").content.decode()

    assert "2026-11-30 08:13:05" in history
    assert "a.m." not in history and "Nov. 30" not in history
