"""Routes in the admin, with their hosts inline in tie-break order."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Prefetch, QuerySet
from django.forms import BaseFormSet, BaseInlineFormSet, ModelForm
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.html import format_html

from routing.config.validation import (
    DUPLICATE_NAME,
    INVALID_VALUE,
    HostSpec,
    RouteSpec,
    config_from_db,
    config_problems,
    route_problems,
)
from routing.models import ConfigFileLoad, Route, RouteHost


class RouteHostFormSet(BaseInlineFormSet):
    """Judges the route together with its hosts and the other routes, as only here all are known.

    `self.instance` is the route as its form just cleaned it, unsaved; the forms hold the hosts
    it is about to have.
    """

    def clean(self) -> None:
        super().clean()
        kept = [
            (form.cleaned_data.get("position") or 0, index, form.cleaned_data["host"].name)
            for index, form in enumerate(self.forms)
            if form.cleaned_data.get("host") and not self._should_delete_form(form)  # type: ignore[attr-defined]  # django-stubs omits BaseFormSet._should_delete_form
        ]
        hosts = [name for _, _, name in sorted(kept)]
        if errors := errors_introduced(
            self.instance.pk, RouteSpec.from_route(self.instance, hosts)
        ):
            raise ValidationError(errors)


def errors_introduced(pk: int | None, edited: RouteSpec) -> list[str]:
    """The errors the configuration would have, with `edited` saved as route `pk`, and has not now.

    Errors already there are not the editor's to fix in this form. Single values and unique
    names are left to the forms, which report them next to the field.
    """
    hosts, routes = config_from_db()
    saved_name = Route.objects.filter(pk=pk).values_list("name", flat=True).first() if pk else None
    # Routes that fall back to this one follow it through a rename (the reference is its pk).
    others = [
        replace(route, fallback=edited.name) if route.fallback == saved_name else route
        for route in routes
        if route.name != saved_name
    ]
    before = set(config_problems(hosts, routes))
    return [
        problem.message
        for problem in config_problems(hosts, [*others, edited])
        if problem.is_error
        and problem.code not in (INVALID_VALUE, DUPLICATE_NAME)
        and problem not in before
    ]


class RouteHostInline(admin.TabularInline):
    model = RouteHost
    formset = RouteHostFormSet
    fields = ["position", "host"]
    extra = 1


@admin.register(Route)
class RouteAdmin(admin.ModelAdmin):
    inlines = [RouteHostInline]
    # The client URL goes right after the name (get_list_display), whole: it is what this list
    # is opened for, and clients copy it.
    list_display = [
        "name",
        "default_model",
        "sticky_mode",
        "lease_ttl",
        "enabled",
        "hosts_in_order",
        "fallback",
    ]
    list_filter = ["enabled", "sticky"]
    search_fields = ["name", "default_model"]

    def get_form(
        self, request: HttpRequest, obj: Route | None = None, change: bool = False, **kwargs: Any
    ) -> type[ModelForm]:
        form = super().get_form(request, obj, change, **kwargs)
        if obj is not None and "fallback" in form.base_fields:
            # A route falling back to itself is refused anyway; do not offer it.
            field = form.base_fields["fallback"]
            field.queryset = field.queryset.exclude(pk=obj.pk)  # type: ignore[attr-defined]  # a ForeignKey's form field: ModelChoiceField
        return form

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        @admin.display(description="client URL")
        def client_url(route: Route) -> str:
            url = route_url(request, route.name)
            return format_html('<span style="white-space: nowrap">{}</span>', url)

        first, *rest = self.list_display
        return [first, client_url, *rest]

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        route = self.get_object(request, object_id) if object_id else None
        context = {
            **(extra_context or {}),
            "client_url": route_url(request, route.name) if route else "",
            "site_root": request.build_absolute_uri("/"),
        }
        return super().changeform_view(request, object_id, form_url, context)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Route]:
        route_hosts = RouteHost.objects.select_related("host")
        routes = super().get_queryset(request).select_related("fallback")
        return routes.prefetch_related(Prefetch("route_hosts", route_hosts))

    @admin.display(description="sticky", ordering="sticky")
    def sticky_mode(self, route: Route) -> str:
        # The value, not its label: "prefer (move a conversation when its host is down)" made
        # the column six lines tall; the filter and the route's page give the label.
        return route.sticky

    @admin.display(description="hosts (in order)")
    def hosts_in_order(self, route: Route) -> str:
        return ", ".join(route_host.host.name for route_host in route.route_hosts.all())

    def save_related(
        self, request: HttpRequest, form: ModelForm, formsets: list[BaseFormSet], change: bool
    ) -> None:
        super().save_related(request, form, formsets, change)
        # What is still wrong with the route's hosts is worth a word: a warning (no hosts), or
        # an error this edit did not introduce and so did not refuse.
        route = form.instance
        hosts = {h.name: HostSpec.from_host(h) for h in route.hosts.prefetch_related("models")}
        for problem in route_problems(RouteSpec.from_route(route), hosts):
            self.message_user(request, problem.message, messages.WARNING)


@admin.register(ConfigFileLoad)
class ConfigFileLoadAdmin(admin.ModelAdmin):
    """When the config file last changed what: written by `crossbar_config load`, read here."""

    list_display = ["loaded_at", "summary", "path", "short_sha256"]
    list_display_links = ["loaded_at"]
    search_fields = ["path", "summary"]
    ordering = ["-loaded", "-pk"]
    # One tuple for both: a list would be invariant against the two attributes' stub types.
    fields = readonly_fields = ("loaded_at", "path", "sha256", "summary")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    @admin.display(description="loaded", ordering="loaded")
    def loaded_at(self, load: ConfigFileLoad) -> str:
        return moment(load.loaded)

    @admin.display(description="sha256")
    def short_sha256(self, load: ConfigFileLoad) -> str:
        return load.sha256[:12]


def route_url(request: HttpRequest, name: str) -> str:
    """The base URL clients give their OpenAI library for route `name`, as this request
    reached the site: `<scheme>://<host>/<route>/v1`."""
    return request.build_absolute_uri(f"/{name}/v1")


def moment(value: datetime) -> str:
    """A time as operators compare them: to the second, in the site's zone."""
    return f"{timezone.localtime(value):%Y-%m-%d %H:%M:%S}"
