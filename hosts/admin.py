"""Hosts in the admin: their models inline, a drain switch that warns before a route loses its
last host, and API keys never shown in clear."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html_join
from django.utils.safestring import mark_safe

from hosts.actions import Said, manage_models, read_from_host, set_draining, unpin
from hosts.describe import Unreachable
from hosts.live import HostStates, host_states
from hosts.models import DRAINING, Host, HostModel, PlacedModel
from hosts.routes_left import left_lines, routes_left_without
from hosts.slots import ROUTER_SAYS_NO_SLOTS, slot_fit, slots_or_why

_LEVELS = {"success": messages.SUCCESS, "warning": messages.WARNING, "error": messages.ERROR}


class HostForm(forms.ModelForm):
    """The API key is write-only: blank keeps the current key, a checkbox clears it."""

    api_key = forms.CharField(
        label="API key",
        required=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
    )
    clear_api_key = forms.BooleanField(label="Clear the API key", required=False)

    class Meta:
        model = Host
        fields = [
            "name",
            "url",
            "shares_url",
            "weight",
            "enabled",
            "loads_on_demand",
            "draining",
            "api_key",
            "swap_budget",
            "min_residency",
            "memory_gb",
            "notes",
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        current = self.instance.masked_api_key
        self.fields["api_key"].help_text = (
            f"A key is set ({current}). Type a new one to replace it; leave blank to keep it."
            if current
            else "Optional. Sent upstream as a Bearer token."
        )

    def clean(self) -> dict[str, Any]:
        super().clean()
        # ModelForm.clean() returns cleaned_data itself; the stubs type it Optional.
        cleaned = self.cleaned_data
        new_key, clear = cleaned.get("api_key"), cleaned.get("clear_api_key")
        if new_key and clear:
            raise forms.ValidationError("Type a new API key or clear it, not both.")
        if new_key or clear:
            cleaned["api_key"] = "" if clear else new_key
            # A key set here no longer comes from the environment variable a load named.
            self.instance.api_key_env = ""
        else:
            cleaned["api_key"] = self.instance.api_key
        return cleaned


class HostModelForm(forms.ModelForm):
    class Meta:
        model = HostModel
        fields = ["name", "aliases", "upstream_name", "parallel", "queue_max"]
        help_texts = {
            "parallel": "Requests in flight at once (llama-server's -np). On save, compared "
            "with the slots the host's /props says it has, as crossbar_config check does: "
            "more than its slots is refused; a host that does not answer is saved, with a "
            "warning."
        }


class SlotCheckedFormSet(forms.BaseInlineFormSet):
    """A host's models, whose `parallel` together must fit the slots the host says it has
    (`hosts.slots`, the rule `crossbar_config check` and `load` apply). Asked only when the
    host is new, its address or key changed, or a model's name or parallel changed (or a
    model came or went): a drain is not held up by a host that does not answer. What is not
    an error is in `warnings`, for the save's messages."""

    instance: Host

    def clean(self) -> None:
        super().clean()
        self.warnings: list[str] = []
        if any(form.errors for form in self.forms) or not self._worth_asking():
            return
        deleted = set(self.deleted_forms)
        parallel = {
            form.cleaned_data["name"]: form.cleaned_data["parallel"]
            for form in self.forms
            if form not in deleted and form.cleaned_data.get("name")
        }
        if not parallel or not self.instance.url:
            return
        host = self.instance
        slots = slots_or_why(host.url, host.api_key)
        if isinstance(slots, str):
            if slots != ROUTER_SAYS_NO_SLOTS:
                self.warnings.append(
                    f"{host.name}: saved, but parallel not compared with the host's slots: {slots}"
                )
            return
        fit = slot_fit(parallel, slots)
        if fit is not None and fit.error:
            raise forms.ValidationError(fit.message)
        if fit is not None:
            self.warnings.append(f"{host.name}: {fit.message}")

    def _worth_asking(self) -> bool:
        if self.deleted_forms or any(
            {"name", "parallel"} & set(form.changed_data) for form in self.forms
        ):
            return True
        # A host not saved yet has no stored row: asked.
        stored = Host.objects.filter(pk=self.instance.pk).values("url", "api_key").first()
        return stored != {"url": self.instance.url, "api_key": self.instance.api_key}


class HostModelInline(admin.TabularInline):
    model = HostModel
    form = HostModelForm
    formset = SlotCheckedFormSet
    fields = ["name", "aliases", "upstream_name", "parallel", "queue_max", "pinned"]
    readonly_fields = ["pinned"]  # set by the load and unload actions, cleared by unpin
    extra = 1


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    form = HostForm
    inlines = [HostModelInline]
    fields = [
        "name",
        "url",
        "shares_url",
        "weight",
        "enabled",
        "loads_on_demand",
        "draining",
        "api_key",
        "clear_api_key",
        "api_key_env",
        "swap_budget",
        "min_residency",
        "memory_gb",
        "notes",
        "live_state",
    ]
    readonly_fields = ["api_key_env", "live_state"]
    list_display = ["name", "url", "enabled", "draining", "weight", "models_summary", "key"]
    list_editable = ["draining"]
    list_filter = ["enabled", "draining"]
    search_fields = ["name", "url", "notes"]
    actions = [
        "start_draining",
        "stop_draining",
        "read_from_host",
        "load_models",
        "unload_models",
        "unpin_models",
    ]

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        # One read of the gateway's state per page, not one per row.
        states = host_states()

        @admin.display(description="live")
        def live(host: Host) -> str:
            return describe_live(states, host)

        # Right after the name: what the gateway sees is what this list is opened for, and the
        # columns past the page's width would hide it.
        first, *rest = self.list_display
        return [first, live, *rest]

    @admin.display(description="live state")
    def live_state(self, host: Host) -> str:
        return describe_live(host_states(), host) if host.pk else "-"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Host]:
        return super().get_queryset(request).prefetch_related("models")

    @admin.display(description="models (parallel/queue)")
    def models_summary(self, host: Host) -> str:
        # A line each: a row of three quantized model names is wider than the screen.
        lines = ((m.name, m.parallel, m.queue_max) for m in host.models.all())
        return format_html_join(mark_safe("<br>"), "{}: {}/{}", lines)

    @admin.display(description="API key")
    def key(self, host: Host) -> str:
        return host.masked_api_key

    @admin.action(description="Start draining the selected hosts")
    def start_draining(
        self, request: HttpRequest, queryset: QuerySet[Host]
    ) -> TemplateResponse | None:
        # Asked first, on a page of its own (as Django's delete action does), when the drain
        # would leave a route with nowhere to send its requests.
        left = routes_left_without(list(queryset.values_list("name", flat=True)))
        if left and request.POST.get("post") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": "Drain a route's last host?",
                "opts": self.opts,
                "hosts": list(queryset),
                "lines": left_lines(left),
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(request, "admin/hosts/host/confirm_drain.html", context)
        self._drain(request, queryset, draining=True)
        for line in left_lines(left):
            self.message_user(request, line, messages.WARNING)
        return None

    def save_model(self, request: HttpRequest, obj: Host, form: Any, change: bool) -> None:
        # The drain box of the change form, or of the list: no page between, so the warning
        # comes with the save's own message.
        drains = change and obj.draining and "draining" in form.changed_data
        left = routes_left_without([form.initial.get("name", obj.name)]) if drains else {}
        super().save_model(request, obj, form, change)
        for line in left_lines(left):
            self.message_user(request, line, messages.WARNING)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        super().save_related(request, form, formsets, change)
        for formset in formsets:
            for line in getattr(formset, "warnings", ()):
                self.message_user(request, line, messages.WARNING)

    @admin.action(description="Stop draining the selected hosts")
    def stop_draining(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        self._drain(request, queryset, draining=False)

    @admin.action(description="Read models and slots from the selected hosts")
    def read_from_host(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        for host in queryset:
            try:
                said = read_from_host(host)
            except Unreachable as exc:
                self.message_user(request, f"{host.name}: cannot read it: {exc}", messages.ERROR)
                continue
            unchanged = Said("success", f"{host.name}: models and slots as the host says")
            for level, line in said or [unchanged]:
                self.message_user(request, line, _LEVELS[level])

    @admin.action(description="Load the selected router-mode hosts' models (and pin them)")
    def load_models(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        self._manage(request, queryset, "load")

    @admin.action(description="Unload the selected router-mode hosts' models (and unpin them)")
    def unload_models(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        self._manage(request, queryset, "unload")

    @admin.action(description="Unpin the selected hosts' models (placement may unload them)")
    def unpin_models(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        changed = unpin(queryset.values_list("name", flat=True))
        text = f"{_counted(changed, 'model')} unpinned: fleet model placement may unload them."
        self.message_user(request, text, messages.SUCCESS)

    def _manage(self, request: HttpRequest, queryset: QuerySet[Host], action: str) -> None:
        for host in queryset:
            for line in manage_models(host, action):
                level = messages.SUCCESS if ": done" in line else messages.WARNING
                self.message_user(request, line, level)

    def _drain(self, request: HttpRequest, queryset: QuerySet[Host], draining: bool) -> None:
        changed = set_draining(queryset.values_list("name", flat=True), draining)
        text = f"{_counted(changed, 'host')} {'started' if draining else 'stopped'} draining"
        if unchanged := queryset.count() - changed:
            text += f" ({unchanged} unchanged)"
        self.message_user(
            request, f"{text}. {DRAINING if draining else ''}".strip(), messages.SUCCESS
        )


@admin.register(PlacedModel)
class PlacedModelAdmin(admin.ModelAdmin):
    """The operator's rules for fleet model placement, one model (by name) at a time."""

    fields = ["name", "min_loaded", "max_loaded", "hosts", "idle_unload", "size_gb"]
    filter_horizontal = ["hosts"]
    list_display = ["name", "min_loaded", "max_loaded", "allowed_hosts", "idle_unload", "size_gb"]
    search_fields = ["name"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[PlacedModel]:
        return super().get_queryset(request).prefetch_related("hosts")

    @admin.display(description="hosts")
    def allowed_hosts(self, placed: PlacedModel) -> str:
        return ", ".join(host.name for host in placed.hosts.all()) or "any that lists it"


def describe_live(states: HostStates, host: Host) -> str:
    """The gateway's view of a host, a line each: health, each model's slots and queue, drain."""
    live = states.get(host.name)
    if live is None:
        return "not in the gateway's configuration yet" if states else "gateway not running here"
    health = str(live.state)
    if live.reason:
        health += f" ({live.reason})"
    if live.since is not None:
        # Read by this process's health polls: a gateway restart starts it again.
        seen = timezone.localtime(datetime.fromtimestamp(live.since, UTC))
        health += f" since {seen:%Y-%m-%d %H:%M:%S} (this gateway's view)"
    lines = [(health, "")]
    if not live.in_a_route:
        lines.append(("in no route: no request is sent to it", ""))
    lines += [
        (f"{m.name} {m.in_flight}/{m.parallel} running, {m.queued} queued", "") for m in live.models
    ]
    # A parallel above the host's slots queues inside llama-server, where the gateway cannot
    # see it; below, slots stay idle.
    if live.slots is not None and (
        fit := slot_fit({m.name: m.parallel for m in live.models}, live.slots)
    ):
        lines.append((f"⚠ {fit.said}", ""))
    lines += [
        (f"⚠ {m.name}: the host emptied a slot between two turns twice since it came up (a "
         "unified KV cache, or restarts not seen): llama-server chooses its slots until the "
         "host is read again", "")
        for m in live.models
        if m.slot_naming is False
    ]  # fmt: skip
    lines += [
        (f"⚠ {m.name}: {_counted(m.shared_slot_lost, 'turn')} on a shared slot got back only "
         "the part their conversations share (start llama-server with "
         "--slot-prompt-similarity 0.95)", "")
        for m in live.models
        if m.shared_slot_lost
    ]  # fmt: skip
    if host.draining:
        busy = live.in_flight + live.queued
        text = "draining, idle" if busy == 0 else f"draining, {busy} still running"
        lines.append((text, "live-draining"))
    # A line each; a line wraps where it must (templates/admin/hosts/host/change_list.html
    # gives the column its width), so the table fits the screen.
    return format_html_join(
        mark_safe("<br>"), '<span class="live-line {}">{}</span>', ((c, t) for t, c in lines)
    )


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
