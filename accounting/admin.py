"""The request history in the admin: read-only, newest first, fast on a million rows.

Client keys are in `accounting.keys_admin`, registered from here.
"""

from __future__ import annotations

import string
from datetime import datetime, timedelta, tzinfo
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html_join
from django.utils.safestring import mark_safe

from accounting.models import Request


class StatusClassFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status_class"
    RANGES = {"2xx": (200, 299), "4xx": (400, 498), "499": (499, 499), "5xx": (500, 599)}

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("2xx", "2xx"),
            ("4xx", "4xx (not 499)"),
            ("499", "499 client gone"),
            ("5xx", "5xx"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Request]) -> QuerySet[Request]:
        value = self.value()
        if value is not None and value in self.RANGES:
            return queryset.filter(status__range=self.RANGES[value])
        return queryset


class PeriodProbingQuerySet(QuerySet[Request]):
    """Requests whose `datetimes()` seeks the index once per period that has rows.

    The admin's date hierarchy lists the days (months, years) holding rows with
    `datetimes()`, which truncates every row's timestamp: on SQLite a Python function call per
    row, three seconds for a million rows in one month. Asking "the first row at or after the
    start of the next period" instead costs one index seek per period shown (31 at most).
    """

    def datetimes(  # type: ignore[override]  # a list, not a QuerySet: the date hierarchy only iterates it
        self, field_name: str, kind: str, order: str = "ASC", tzinfo: tzinfo | None = None
    ) -> list[datetime]:
        zone = tzinfo or timezone.get_current_timezone()
        moments = self.order_by(field_name).values_list(field_name, flat=True)
        periods: list[datetime] = []
        moment = moments.first()
        while moment is not None:
            periods.append(_period_start(moment.astimezone(zone), kind))
            later = {f"{field_name}__gte": _next_period(periods[-1], kind)}
            moment = moments.filter(**later).first()
        return periods if order == "ASC" else periods[::-1]


def _period_start(moment: datetime, kind: str) -> datetime:
    if kind == "year":
        return moment.replace(month=1, day=1, hour=0, minute=0, second=0, microsecond=0)
    if kind == "month":
        return moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return moment.replace(hour=0, minute=0, second=0, microsecond=0)


def _next_period(start: datetime, kind: str) -> datetime:
    if kind == "year":
        return start.replace(year=start.year + 1)
    if kind == "month":
        return start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    return start + timedelta(days=1)


@admin.register(Request)
class RequestAdmin(admin.ModelAdmin):
    # Chosen to fit a 1366-pixel screen beside the filters: lease and streamed are filters
    # only, token counts share a column, headers are short (tests/accounting/
    # test_requests_admin_browser.py measures it).
    list_display = (
        "started_at",
        "route",
        "model",
        "host",
        "client",
        "status",
        "error_code",
        "queued",
        "ttfb",
        "total",
        "tokens",
        "cache_hit_percent",
        "short_fingerprint",
    )
    list_filter = (
        "route",
        "host",
        "model",
        "client",
        StatusClassFilter,
        "code",
        "streamed",
        "lease",
        "placement",
    )
    date_hierarchy = "started"
    search_fields = ("fingerprint",)
    search_help_text = "A fingerprint or its first hex characters, e.g. 3fa9c2."
    ordering = ("-started",)
    list_per_page = 100
    # A filtered list would otherwise count the whole table again, for "(N total)".
    show_full_result_count = False

    # The row's page, read to learn what went wrong: the status, the code and the reason
    # first, then when, where and how much; the start to the second (not "8:13 a.m.") and once.
    fieldsets = (
        (None, {"fields": ("status_said", "code", "error")}),
        ("When", {"fields": ("started_at", "queued_ms", "ttfb_ms", "total_ms")}),
        (
            "Where",
            {
                "fields": (
                    "route",
                    "model",
                    "host",
                    "refused_by",
                    "client",
                    "placement",
                    "lease",
                    "fallback",
                    "fingerprint",
                    "streamed",
                )  # fmt: skip
            },
        ),
        ("Tokens", {"fields": ("prompt_tokens", "cached_tokens", "completion_tokens")}),
        # The prefix index's guess against the host's word (a lost cache: the first well above).
        ("Cache", {"fields": ("predicted_cached_blocks", "reported_cached_blocks")}),
        # Priced patience's choice for a request that waited, and the two prices it compared.
        ("Patience", {"fields": ("patience", "patience_stay_ms", "patience_spill_ms")}),
    )
    readonly_fields = ("started_at", "status_said")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Request]:
        return PeriodProbingQuerySet(Request).order_by(*self.get_ordering(request))

    # History is written by the gateway only; old rows go with `manage.py requests_prune`,
    # which deletes in batches rather than loading every row for a confirmation page.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Request], search_term: str
    ) -> tuple[QuerySet[Request], bool]:
        prefix = search_term.strip().lower()
        if not prefix:
            return queryset, False
        if not set(prefix) <= set(string.hexdigits.lower()):
            return queryset.none(), False
        # A range rather than LIKE 'prefix%': the fingerprint index serves a range on both
        # SQLite (whose LIKE ignores case, so cannot use it) and PostgreSQL (whose LIKE needs a
        # pattern-ops index). Every hex digit sorts before "g".
        return queryset.filter(fingerprint__gte=prefix, fingerprint__lt=prefix + "g"), False

    @admin.display(description="started", ordering="started")
    def started_at(self, obj: Request) -> str:
        return moment(obj.started)

    @admin.display(description="status")
    def status_said(self, obj: Request) -> str:
        # The one status no HTTP reference explains: the gateway's record of a client that left.
        return f"{obj.status} (the client went away)" if obj.status == 499 else str(obj.status)

    @admin.display(description="code", ordering="code")
    def error_code(self, obj: Request) -> str | None:
        if not obj.code:
            return None
        # A long code (upstream_unreachable) may break after an underscore, not widen the table.
        return format_html_join(
            mark_safe("<wbr>"), "{}", ((part,) for part in _after_underscores(obj.code))
        )

    @admin.display(description="queued (ms)", ordering="queued_ms")
    def queued(self, obj: Request) -> int:
        return obj.queued_ms

    @admin.display(description="TTFB (ms)", ordering="ttfb_ms")
    def ttfb(self, obj: Request) -> int | None:
        return obj.ttfb_ms

    @admin.display(description="total (ms)", ordering="total_ms")
    def total(self, obj: Request) -> int:
        return obj.total_ms

    @admin.display(description="tokens in/out")
    def tokens(self, obj: Request) -> str | None:
        # The cached share is the next column; the cached count is on the row's own page.
        if obj.prompt_tokens is None and obj.completion_tokens is None:
            return None
        return "/".join(
            "-" if count is None else str(count)
            for count in (obj.prompt_tokens, obj.completion_tokens)
        )

    @admin.display(description="cache hit")
    def cache_hit_percent(self, obj: Request) -> str | None:
        return None if obj.cache_hit is None else f"{obj.cache_hit:.0%}"

    @admin.display(description="fingerprint", ordering="fingerprint")
    def short_fingerprint(self, obj: Request) -> str | None:
        return obj.fingerprint[:8] or None


def _after_underscores(code: str) -> list[str]:
    parts = code.split("_")
    return [part + "_" for part in parts[:-1]] + parts[-1:]


def moment(value: datetime) -> str:
    """A time as operators compare them: to the second, in the site's zone (UTC by default)."""
    return f"{timezone.localtime(value):%Y-%m-%d %H:%M:%S}"


# Client keys have their own module; importing it registers their admin (after `moment`, which
# it uses, is defined).
from accounting import keys_admin  # noqa: E402, F401
