"""Routes in the admin, with their hosts inline in tie-break order."""

from __future__ import annotations

from collections.abc import Iterable

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Prefetch, QuerySet
from django.forms import BaseFormSet, BaseInlineFormSet, ModelForm
from django.http import HttpRequest

from hosts.models import Host
from routing.models import Route, RouteHost
from routing.validation import HostSpec, RouteSpec, route_problems, single_values


class RouteHostFormSet(BaseInlineFormSet):
    """Judges the route together with its hosts, since only here are both known.

    `self.instance` is the route as its form just cleaned it, unsaved; the forms hold the hosts
    it is about to have.
    """

    def clean(self) -> None:
        super().clean()
        kept = [
            (form.cleaned_data.get("position") or 0, index, form.cleaned_data["host"])
            for index, form in enumerate(self.forms)
            if form.cleaned_data.get("host") and not self._should_delete_form(form)
        ]
        hosts = [host for _, _, host in sorted(kept, key=lambda item: item[:2])]
        route = RouteSpec(**single_values(self.instance, RouteSpec), hosts=[h.name for h in hosts])
        errors = [p.message for p in route_problems(route, _host_specs(hosts)) if p.is_error]
        if errors:
            raise ValidationError(errors)


class RouteHostInline(admin.TabularInline):
    model = RouteHost
    formset = RouteHostFormSet
    fields = ["position", "host"]
    extra = 1


@admin.register(Route)
class RouteAdmin(admin.ModelAdmin):
    inlines = [RouteHostInline]
    list_display = ["name", "default_model", "sticky", "lease_ttl", "enabled", "hosts_in_order"]
    list_filter = ["enabled", "sticky"]
    search_fields = ["name", "default_model"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Route]:
        route_hosts = RouteHost.objects.select_related("host")
        return super().get_queryset(request).prefetch_related(Prefetch("route_hosts", route_hosts))

    @admin.display(description="hosts (in order)")
    def hosts_in_order(self, route: Route) -> str:
        return ", ".join(route_host.host.name for route_host in route.route_hosts.all())

    def save_related(
        self, request: HttpRequest, form: ModelForm, formsets: list[BaseFormSet], change: bool
    ) -> None:
        super().save_related(request, form, formsets, change)
        # Errors never get this far (the inline formset refuses them); warnings are worth a word.
        route = form.instance
        hosts = _host_specs(route.hosts.prefetch_related("models"))
        for problem in route_problems(RouteSpec.from_route(route), hosts):
            self.message_user(request, problem.message, messages.WARNING)


def _host_specs(hosts: Iterable[Host]) -> dict[str, HostSpec]:
    return {host.name: HostSpec.from_host(host) for host in hosts}
