from functools import cache
from pathlib import Path

from django.contrib import admin
from django.contrib.staticfiles import finders
from django.http import HttpRequest, HttpResponse
from django.urls import path, re_path

from routing.ops.dashboard import dashboard_page
from routing.ops.metrics import metrics_view
from routing.proxy.view import proxy

admin.site.site_url = "/dashboard/"  # the admin's "View site" link
admin.site.site_header = "crossbar"
admin.site.site_title = "crossbar admin"
admin.site.index_title = "Hosts, routes, client keys and requests"
# No app list beside every page: the lists need its width to fit 1366 px (the host, route and
# request lists are measured in tests/ops/test_admin_lists_browser.py and
# tests/accounting/test_requests_admin_browser.py); Home lists the apps one click away.
admin.site.enable_nav_sidebar = False

_FAVICON = "crossbar/favicon.ico"


@cache
def _favicon_bytes() -> bytes:
    return Path(finders.find(_FAVICON)).read_bytes()  # type: ignore[arg-type]  # None only if crossbar_site/static lost the icon


def favicon(request: HttpRequest) -> HttpResponse:
    """The site's icon where browsers ask for it, whatever page they are on (else the proxy
    would answer every tab's request with a 404 and log it as a request row)."""
    return HttpResponse(
        _favicon_bytes(),
        content_type="image/x-icon",
        headers={"Cache-Control": "public, max-age=86400"},
    )


urlpatterns = [
    path("admin/", admin.site.urls),
    path("dashboard/", dashboard_page, name="dashboard"),
    path("metrics", metrics_view, name="metrics"),
    path("favicon.ico", favicon, name="favicon"),
    # Everything else is the gateway's: /<route>/v1/..., /v1/... with X-Crossbar-Route, /health.
    re_path(r"^", proxy),
]
