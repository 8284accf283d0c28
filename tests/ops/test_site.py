"""The site as a person meets it: the admin behind a login, served by the real server."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_real_server_shows_the_admin_login_page(gateway):
    response = httpx.get(f"{gateway.url}/admin/", follow_redirects=True)

    assert response.status_code == 200
    assert str(response.url).startswith(f"{gateway.url}/admin/login/")
    assert 'name="password"' in response.text


def test_the_admin_styles_are_served_without_collectstatic(gateway):
    page = httpx.get(f"{gateway.url}/admin/login/")
    css = httpx.get(f"{gateway.url}/static/admin/css/base.css")

    assert "/static/admin/css/base.css" in page.text
    assert css.status_code == 200 and "body" in css.text


def test_the_gateway_reports_its_own_health(gateway):
    response = httpx.get(f"{gateway.url}/health")

    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_debug_pages_are_off(gateway):
    response = httpx.get(f"{gateway.url}/admin/no-such-page/", follow_redirects=False)

    assert "Traceback" not in response.text and "DEBUG = True" not in response.text
