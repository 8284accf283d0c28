from django.contrib import admin
from django.urls import path, re_path

from routing.proxy import proxy

urlpatterns = [
    path("admin/", admin.site.urls),
    # Everything else is the gateway's: /<route>/v1/..., /v1/... with X-Crossbar-Route, /health.
    re_path(r"^", proxy),
]
