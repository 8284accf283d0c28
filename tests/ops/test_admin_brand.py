"""The admin as crossbar's own: its name, its icon, and the live dashboard one click away."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model

from tests.helpers.gateway import signed_in

ROOT = Path(__file__).resolve().parent.parent.parent
ICON = ROOT / "crossbar_site" / "static" / "crossbar" / "favicon.ico"

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_site_serves_its_own_favicon_not_the_gateways_404(gateway):
    response = httpx.get(f"{gateway.url}/favicon.ico")

    assert response.status_code == 200
    assert response.headers["content-type"] == "image/x-icon"
    assert response.content == ICON.read_bytes()
    assert response.content[:4] == b"\x00\x00\x01\x00"  # an ICO file
    assert response.headers["cache-control"] == "public, max-age=86400"


def test_the_login_page_is_branded_crossbar_with_its_icon(gateway):
    page = httpx.get(f"{gateway.url}/admin/login/").text

    assert "<title>Log in | crossbar admin</title>" in page
    assert '<a href="/admin/">crossbar</a>' in page
    assert 'rel="icon" href="/favicon.ico"' in page
    assert "Django administration" not in page and "Django site admin" not in page


def test_signed_in_pages_name_crossbar_and_link_the_live_dashboard(gateway):
    get_user_model().objects.create_superuser("admin", "", "password")
    client = signed_in(gateway)
    try:
        index = client.get("/admin/").text
        hosts = client.get("/admin/hosts/host/").text
    finally:
        client.close()

    assert "<title>Hosts, routes, client keys and requests | crossbar admin</title>" in index
    assert "<h1>Hosts, routes, client keys and requests</h1>" in index
    for page in (index, hosts):
        assert '<a href="/dashboard/" id="live-dashboard">Live dashboard</a>' in page
        assert '<a href="/admin/">crossbar</a>' in page
        assert "Django administration" not in page
