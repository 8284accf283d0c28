"""One row per request the gateway answered: who asked, where it went, how long it took."""

from __future__ import annotations

from django.apps import apps
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from accounting.keys import hash_key, new_key, shown_prefix


class Request(models.Model):
    """A request as the gateway saw it.

    Names (route, model, host, client) are stored as plain strings, not foreign keys, so the
    history survives hosts and routes being renamed or deleted. Token counts are null when the
    engine did not report them; a null is never written as 0.
    """

    class Lease(models.TextChoices):
        NEW = "new", "new"
        REUSED = "reused", "reused"
        MOVED = "moved", "moved"
        SPILLED = "spilled", "spilled"
        NONE = "", "none"

    class Placement(models.TextChoices):
        HOME = "home", "home"  # the conversation's lease host
        NEW = "new", "new"  # a new conversation, to the host with the most free slots
        SPILLED = "spilled", "spilled"  # patience spent, or home's queue full
        MOVED = "moved", "moved"  # home down or draining
        FALLBACK = "fallback", "fallback"  # the route's fallback route served
        NONE = "none", "none"  # no conversation (e.g. a GET) or no host reached

    class Patience(models.TextChoices):
        STAY = "stay", "stay"  # the wait in line was priced lower (or nothing else was free)
        SPILL = "spill", "spill"  # the cold start on another host was priced lower
        DEFAULT = "default", "default"  # a figure was missing: the fixed default decided
        NONE = "", "none"  # not priced: no wait, or a route with a fixed lease_patience

    route = models.CharField(max_length=64, blank=True, help_text="Empty when none was named.")
    fingerprint = models.CharField(
        max_length=64, blank=True, help_text="The conversation's fingerprint (hex sha256), if any."
    )
    model = models.CharField(max_length=200, blank=True)
    host = models.CharField(
        max_length=64,
        blank=True,
        help_text="Empty when no host was chosen, and when the route refused the request.",
    )
    started = models.DateTimeField(db_index=True)
    queued_ms = models.PositiveIntegerField("queued (ms)", help_text="Waiting for a slot.")
    ttfb_ms = models.PositiveIntegerField(
        "TTFB (ms)",
        null=True,
        blank=True,
        help_text="Until the response head; empty when none came.",
    )
    total_ms = models.PositiveIntegerField("total (ms)")
    status = models.PositiveSmallIntegerField()
    streamed = models.BooleanField(default=False)
    lease = models.CharField(max_length=10, choices=Lease.choices, blank=True)
    prompt_tokens = models.PositiveIntegerField(
        null=True, blank=True, help_text="The whole prompt, cached part included."
    )
    cached_tokens = models.PositiveIntegerField(
        null=True, blank=True, help_text="The part of the prompt served from the KV cache."
    )
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    client = models.CharField(max_length=100, blank=True, help_text="The client key's name.")
    fallback = models.CharField(
        max_length=64, blank=True, help_text="The fallback route taken, if any."
    )
    placement = models.CharField(
        max_length=10,
        choices=Placement.choices,
        blank=True,
        help_text="Why the request went to its host.",
    )
    code = models.CharField(
        max_length=40,
        blank=True,
        db_index=True,
        help_text="The error's code (e.g. queue_full); empty when the request succeeded.",
    )
    refused_by = models.TextField(
        blank=True,
        help_text="The hosts that were full when the route refused the request (queue_full), "
        "separated by spaces. The refusal is the route's: `host` is empty.",
    )
    # The gateway's prefix index against the host's own word, in blocks of the prompt (256
    # characters of its canonical text, or 64 token ids: routing/core/prefixes.py).
    predicted_cached_blocks = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The prompt's leading blocks the gateway expected the host to have cached; "
        "empty when it made no prediction (no prompt, or no host reached).",
    )
    reported_cached_blocks = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The prompt's leading blocks the host reported cached (its cached tokens, "
        "in blocks); empty when it did not say.",
    )
    # A route's `lease_patience = "auto"` prices a wait in line against a cold start elsewhere
    # (routing/core/patience.py): its last choice for the request, and the two prices.
    patience = models.CharField(
        max_length=10,
        choices=Patience.choices,
        blank=True,
        help_text="What priced patience chose for a request that waited; empty when it did "
        "not price the wait.",
    )
    patience_stay_ms = models.PositiveIntegerField(
        "patience stay (ms)",
        null=True,
        blank=True,
        help_text="The expected ms to the first token staying in line (the wait, then the "
        "prompt's uncached part); empty when a figure was missing.",
    )
    patience_spill_ms = models.PositiveIntegerField(
        "patience spill (ms)",
        null=True,
        blank=True,
        help_text="The expected delay of a spill: ms to the first token on the other host's "
        "free slot (its prefill of what it does not hold), once more for each request running "
        "there; empty when a figure was missing or nothing was free.",
    )

    class Meta:
        indexes = [
            # The admin filters by one name and lists newest first; these serve both the filter
            # and its "distinct values" lookup without touching the table.
            models.Index(fields=["route", "started"], name="request_route_started"),
            models.Index(fields=["host", "started"], name="request_host_started"),
            models.Index(fields=["model", "started"], name="request_model_started"),
            # The client filter, and each client key's "last used" and "requests (24 h)".
            models.Index(fields=["client", "started"], name="request_client_started"),
            # Fingerprint search is a prefix range (see the admin), which a plain btree serves.
            models.Index(fields=["fingerprint"], name="request_fingerprint"),
        ]

    def __str__(self) -> str:
        return f"{self.route} {self.model} {self.status} at {self.started:%Y-%m-%d %H:%M:%S}"

    @property
    def cache_hit(self) -> float | None:
        """The share of the prompt served from cache, when both counts are known."""
        if self.prompt_tokens and self.cached_tokens is not None:
            return self.cached_tokens / self.prompt_tokens
        return None


class ClientKey(models.Model):
    """A key a client sends as `Authorization: Bearer <key>`, and what it may do.

    Only the key's sha256 and its first characters are stored; the key itself is shown once,
    when it is issued. Route names are plain strings, like a Request's, so accounting does not
    depend on routing.
    """

    name = models.CharField(
        max_length=100, unique=True, help_text="Shown on request rows, in reports and metrics."
    )
    prefix = models.CharField(
        max_length=16, editable=False, help_text="The start of the key, to recognize it."
    )
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    enabled = models.BooleanField(default=True)
    routes = models.CharField(
        max_length=1000,
        blank=True,
        help_text="Route names the key may use, separated by commas or spaces; empty: every route.",
    )
    max_concurrent = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests in flight at once; more get 429. Empty: no limit.",
    )
    requests_per_minute = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests started in any 60 seconds; more get 429. Empty: no limit.",
    )
    priority = models.CharField(
        max_length=12,
        choices=[
            ("interactive", "interactive"),
            ("standard", "standard"),
            ("batch", "batch"),
        ],
        default="standard",
        help_text=(
            "Who goes first when a host's slot frees: interactive, then standard, then batch. "
            "A request waiting longer than CROSSBAR_STARVATION_BOUND seconds goes first "
            "whatever its class. Requests without a key are standard."
        ),
    )
    weight = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.001)],
        help_text=(
            "This key's share of the slots among the keys of its class that are waiting, "
            "counted in work the hosts did (prompt tokens evaluated, generated ones): a key "
            "of weight 2 gets twice the work of a key of weight 1. Above 0."
        ),
    )
    # Budgets count what rows count: the whole prompt, its cached part included (a client
    # cannot tell what a host holds, so its spend must not depend on it), plus generated tokens.
    tokens_per_day = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text=(
            "Tokens the key may spend per day (UTC): prompt tokens, cached ones included, plus "
            "generated tokens, as request rows count them. Past it, requests get 429 "
            "budget_exhausted until midnight UTC; a request already running finishes, so the "
            "spend may pass the budget by that request's size. Empty: no budget."
        ),
    )
    tokens_per_month = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text=(
            "The same per calendar month (UTC): refused until the 1st, 00:00 UTC. Empty: no budget."
        ),
    )
    created = models.DateTimeField(auto_now_add=True)
    notes = models.TextField(blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def route_names(self) -> list[str]:
        return self.routes.replace(",", " ").split()

    def clean(self) -> None:
        """Refuse route names no route has (a key limited to a typo could use nothing)."""
        if unknown := unknown_routes(self.route_names):
            raise ValidationError({"routes": [no_such_route(self.name, name) for name in unknown]})

    def issue_key(self) -> str:
        """Give the row a new random key and return it: the only time it exists in clear.

        The caller saves the row; the old key, if any, stops working once it is saved.
        """
        key = new_key()
        self.key_hash = hash_key(key)
        self.prefix = shown_prefix(key)
        return key


def unknown_routes(names: list[str]) -> list[str]:
    """Those of `names` that no route has, in order.

    Routes are looked up by app label so that accounting does not import routing.
    """
    route_model = apps.get_model("routing", "Route")
    known = set(route_model.objects.filter(name__in=names).values_list("name", flat=True))
    return [name for name in dict.fromkeys(names) if name not in known]


def no_such_route(key: str, route: str) -> str:
    return f"Client key “{key}” names route “{route}”, which does not exist."
