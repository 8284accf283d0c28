from django.contrib import admin
from django.urls import path, re_path

from routing.ops.dashboard import dashboard_page
from routing.ops.metrics import metrics_view
from routing.proxy.view import proxy

admin.site.site_url = "/dashboard/"  # the admin's "View site" link

urlpatterns = [
    path("admin/", admin.site.urls),
    path("dashboard/", dashboard_page, name="dashboard"),
    path("metrics", metrics_view, name="metrics"),
    # Everything else is the gateway's: /<route>/v1/..., /v1/... with X-Crossbar-Route, /health.
    re_path(r"^", proxy),
]
