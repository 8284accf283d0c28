"""Client keys in the admin: routes picked from the real ones, confirmations before a step that
locks clients out, and a new key shown once, on the page that answers the save.

A new key is never put in a message, the session or a log: it exists only in the response to
the POST that issued it (sent with `Cache-Control: no-store`), and hashed in the row.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from django import forms
from django.apps import apps
from django.conf import settings
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import unquote
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers

from accounting.admin import moment
from accounting.models import ClientKey, Request
from accounting.spend import spend_periods, spent_of, tokens_since

CONFIRM = "_confirm_authentication"  # the POST field the confirmation page adds
ISSUED_TEMPLATE = "admin/accounting/clientkey/issued.html"


class ClientKeyForm(forms.ModelForm):
    """`routes` as a choice of the routes that exist, stored as the names joined by commas.

    A name the key already has but no route has (the route was renamed or deleted) is offered
    too, marked, so the operator sees it and unticks it; saving with it is refused.
    """

    routes = forms.MultipleChoiceField(
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="The routes this key may use. None ticked: every route.",
    )

    class Meta:
        model = ClientKey
        fields = [
            "name", "enabled", "routes", "max_concurrent", "requests_per_minute", "priority",
            "weight", "tokens_per_day", "tokens_per_month", "notes",
        ]  # fmt: skip

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        route_model = apps.get_model("routing", "Route")
        names = list(route_model.objects.order_by("name").values_list("name", flat=True))
        stored = self.instance.route_names if self.instance.pk else []
        missing = [name for name in stored if name not in names]
        field = cast(forms.MultipleChoiceField, self.fields["routes"])  # declared above
        field.choices = [(name, name) for name in names] + [
            (name, f"{name} (no such route)") for name in missing
        ]
        self.initial["routes"] = stored
        for name in ("priority", "weight"):  # absent from a POST: the key's own (default)
            self.fields[name].required = False

    def clean_priority(self) -> str:
        # A form sent without the field (a script's POST) keeps the key's class as it was.
        return self.cleaned_data["priority"] or self.instance.priority

    def clean_weight(self) -> float:
        weight = self.cleaned_data["weight"]
        return self.instance.weight if weight is None else weight

    def clean_tokens_per_day(self) -> int | None:
        return self._kept("tokens_per_day")

    def clean_tokens_per_month(self) -> int | None:
        return self._kept("tokens_per_month")

    def _kept(self, name: str) -> int | None:
        # A form sent without the field keeps the key's budget; sent empty, it clears it.
        if name not in self.data:
            return cast(int | None, getattr(self.instance, name))
        return cast(int | None, self.cleaned_data[name])

    def clean_routes(self) -> str:
        # ClientKey.clean() refuses names no route has, with the same words as `check`.
        return ", ".join(self.cleaned_data["routes"])


class ClientKeyAdmin(admin.ModelAdmin):
    form = ClientKeyForm
    list_display = [
        "name", "key_start", "enabled", "allowed_routes", "limits", "tokens_spent", "last_used_at",
        "requests_24h",
    ]  # fmt: skip
    list_filter = ["enabled"]
    search_fields = ["name", "prefix", "notes"]
    fields = [
        "name", "key_start", "enabled", "routes", "max_concurrent", "requests_per_minute",
        "priority", "weight", "tokens_per_day", "tokens_per_month", "tokens_spent", "notes",
        "created_at",
    ]  # fmt: skip
    readonly_fields = ["key_start", "tokens_spent", "created_at"]
    actions = ["replace_keys"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[ClientKey]:
        # From the request rows (client = the key's name), so the request path writes nothing
        # more; each is one seek on the (client, started) index.
        rows = Request.objects.filter(client=OuterRef("name")).order_by()
        since = timezone.now() - timedelta(hours=24)
        recent = rows.filter(started__gte=since).values("client").annotate(n=Count("pk"))
        day, month = spend_periods(timezone.now())
        return (
            super()
            .get_queryset(request)
            .annotate(
                last_used=Subquery(rows.order_by("-started").values("started")[:1]),
                requests_24h=Coalesce(
                    Subquery(recent.values("n"), output_field=IntegerField()), Value(0)
                ),
                tokens_today=tokens_since(rows, day),
                tokens_month=tokens_since(rows, month),
            )
        )

    @admin.display(description="key")
    def key_start(self, key: ClientKey) -> str:
        return f"{key.prefix}…" if key.prefix else "issued when saved"

    @admin.display(description="routes")
    def allowed_routes(self, key: ClientKey) -> str:
        return ", ".join(key.route_names) or "every route"

    @admin.display(description="limits")
    def limits(self, key: ClientKey) -> str:
        parts = []
        if key.max_concurrent:
            parts.append(f"{key.max_concurrent} in flight")
        if key.requests_per_minute:
            parts.append(f"{key.requests_per_minute}/min")
        if key.priority != "standard" or key.weight != 1:
            parts.append(f"{key.priority} x{key.weight:g}")
        return ", ".join(parts) or "none"

    @admin.display(description="tokens (today, month; UTC)")
    def tokens_spent(self, key: ClientKey) -> str:
        """Spent against the budgets, as the gateway counts them (read from the rows)."""
        if not key.pk:
            return "-"
        return (
            f"{spent_of(key.tokens_today, key.tokens_per_day)} today, "  # type: ignore[attr-defined]  # annotated by get_queryset
            f"{spent_of(key.tokens_month, key.tokens_per_month)} this month"  # type: ignore[attr-defined]  # annotated by get_queryset
        )

    @admin.display(description="created", ordering="created")
    def created_at(self, key: ClientKey) -> str:
        return moment(key.created) if key.created else "-"

    @admin.display(description="last used", ordering="last_used")
    def last_used_at(self, key: ClientKey) -> str:
        return moment(key.last_used) if key.last_used else "never"  # type: ignore[attr-defined]  # annotated by get_queryset

    @admin.display(description="requests (24 h)", ordering="requests_24h")
    def requests_24h(self, key: ClientKey) -> int:
        return key.requests_24h  # type: ignore[attr-defined]  # annotated by get_queryset

    # -- the first enabled key turns authentication on ----------------------------------------

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        if request.method == "POST" and CONFIRM not in request.POST:
            if confirmation := self._confirm_authentication(request, object_id):
                return confirmation
        return super().changeform_view(request, object_id, form_url, extra_context)

    def _confirm_authentication(
        self, request: HttpRequest, object_id: str | None
    ) -> HttpResponse | None:
        """The confirmation page, when this save would turn authentication on; else None."""
        key = self.get_object(request, unquote(object_id)) if object_id else None
        allowed = (
            self.has_change_permission(request, key) if key else self.has_add_permission(request)
        )
        if not allowed or (object_id and key is None) or settings.CROSSBAR["REQUIRE_KEY"]:
            return None
        was_enabled = bool(key and key.enabled)
        form = self.get_form(request, key, change=key is not None)(request.POST, instance=key)
        if was_enabled or not form.is_valid() or not form.cleaned_data["enabled"]:
            return None
        others = ClientKey.objects.filter(enabled=True)
        if key is not None:
            others = others.exclude(pk=key.pk)
        if others.exists():
            return None
        since = timezone.now() - timedelta(hours=24)
        context = {
            **self.admin_site.each_context(request),
            "title": "Turn authentication on for every client?",
            "opts": self.opts,
            "key_name": form.cleaned_data["name"],
            "posted": [
                (name, value)
                for name, values in request.POST.lists()
                if name != "csrfmiddlewaretoken"
                for value in values
            ],
            "confirm_field": CONFIRM,
            "keyless_24h": Request.objects.filter(client="", started__gte=since).count(),
        }
        return TemplateResponse(
            request, "admin/accounting/clientkey/confirm_authentication.html", context
        )

    # -- a key issued is shown once ---------------------------------------------------------

    def save_model(self, request: HttpRequest, obj: ClientKey, form: Any, change: bool) -> None:
        if not change:
            # Kept on the instance only until response_add renders it.
            obj._issued_key = obj.issue_key()  # type: ignore[attr-defined]  # transient, not a field
        super().save_model(request, obj, form, change)

    def response_add(
        self, request: HttpRequest, obj: ClientKey, post_url_continue: str | None = None
    ) -> HttpResponse:
        secret = getattr(obj, "_issued_key", None)
        if secret is None:
            return super().response_add(request, obj, post_url_continue)
        return self._issued_page(request, [(obj, secret)], "Client key added")

    @admin.action(description="Replace the keys of the selected clients")
    def replace_keys(self, request: HttpRequest, queryset: QuerySet[ClientKey]) -> HttpResponse:
        if request.POST.get("post") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": "Replace these keys?",
                "opts": self.opts,
                "keys": list(queryset),
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(
                request, "admin/accounting/clientkey/confirm_replace.html", context
            )
        issued = []
        for key in queryset:
            secret = key.issue_key()
            key.save(update_fields=["key_hash", "prefix"])
            self.log_change(request, key, "Replaced the key.")
            issued.append((key, secret))
        return self._issued_page(request, issued, "Keys replaced")

    def _issued_page(
        self, request: HttpRequest, issued: list[tuple[ClientKey, str]], title: str
    ) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.opts,
            "issued": issued,
        }
        response = TemplateResponse(request, ISSUED_TEMPLATE, context)
        add_never_cache_headers(response)
        return response


admin.site.register(ClientKey, ClientKeyAdmin)
