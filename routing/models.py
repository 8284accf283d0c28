"""Routes: the names clients use in the URL, and the hosts behind each."""

from __future__ import annotations

import math
import secrets

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from hosts.models import Host
from routing.core.cors import not_origins

# First path segments the gateway itself answers; a route may not shadow them.
RESERVED_ROUTE_NAMES = frozenset(
    {"admin", "static", "v1", "health", "props", "metrics", "dashboard", "api"}
)


def validate_seconds(value: float) -> None:
    # `not value >= 0` also refuses NaN, which TOML can spell.
    if not value >= 0 or math.isinf(value):
        raise ValidationError("Enter a number of seconds, 0 or more.")


def validate_route_name(value: str) -> None:
    if value.lower() in RESERVED_ROUTE_NAMES:
        raise ValidationError(
            f"“{value}” is reserved for the gateway's own pages; choose another route name."
        )


def validate_origins(value: str) -> None:
    if wrong := not_origins(value):
        raise ValidationError(
            f"“{wrong[0]}” is not an origin: write scheme://host[:port] (no path, no trailing "
            "slash), or * for any origin without credentials."
        )


class Route(models.Model):
    """A name clients put in the path (`/<route>/v1/...`) and the hosts that serve it."""

    class Sticky(models.TextChoices):
        PREFER = "prefer", "prefer (move a conversation when its host is down)"
        STRICT = "strict", "strict (answer 503 when its host is down)"

    name = models.SlugField(max_length=64, unique=True, validators=[validate_route_name])
    default_model = models.CharField(
        max_length=200, blank=True, help_text="Used when a request names no model."
    )
    lease_ttl = models.PositiveIntegerField(
        "lease TTL",
        default=1200,
        validators=[MinValueValidator(1)],
        help_text="Seconds a conversation stays on its host after its last request.",
    )
    sticky = models.CharField(max_length=10, choices=Sticky.choices, default=Sticky.PREFER)
    enabled = models.BooleanField(default=True)
    wait_status = models.BooleanField(
        default=False,
        help_text="A streaming request that must queue gets its response head at once and "
        "SSE comments (“: crossbar-status: waiting 2”) while it waits. "
        "Clients can override it with the X-Crossbar-Wait-Status header (on/off).",
    )
    queue_timeout = models.PositiveIntegerField(
        default=300,
        validators=[MinValueValidator(1)],
        help_text="Seconds a request may wait for a slot before it gets 503 queue timeout.",
    )
    lease_patience = models.FloatField(
        null=True,
        blank=True,
        default=None,
        validators=[validate_seconds],
        help_text="Seconds a conversation waits for its own (cache-warm) host before it goes "
        "to another host with a free slot. 0: never wait while another host is free. Empty: "
        "auto, whichever costs less: the wait in line at home, or the prompt evaluated cold "
        "on the other host (which the requests running there wait for too), as the hosts' "
        "recent answers price them.",
    )
    fallback = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="fallback_for",
        help_text="Another route that takes a request which waited fallback_after seconds.",
    )
    fallback_after = models.FloatField(
        default=10.0,
        validators=[validate_seconds],
        help_text="Seconds a request waits (queued, or for a healthy host) before the fallback.",
    )
    fallback_model = models.CharField(
        max_length=200,
        blank=True,
        help_text="The model to ask the fallback route for; empty: the same model.",
    )
    pass_credentials = models.BooleanField(
        default=False,
        help_text=(
            "Send the client's own Authorization / X-Api-Key to the hosts (for fleets whose "
            "llama-servers check their own keys). Off: the host's api_key is sent instead."
        ),
    )
    map_unknown_models = models.BooleanField(
        default=False,
        help_text=(
            "Serve a model name the route does not know (gpt-3.5-turbo, test, ...) with the "
            "default model."
        ),
    )
    manage_models = models.BooleanField(
        default=False,
        help_text="Let clients load and unload models on router-mode hosts (/models/load, "
        "/models/unload). Off: only operators, from the host admin.",
    )
    cors_origins = models.CharField(
        "CORS origins",
        max_length=1000,
        blank=True,
        validators=[validate_origins],
        help_text="Web pages (origins, e.g. https://chat.example.com) whose scripts may call the "
        "route from a browser, with credentials, separated by spaces or commas; * adds every "
        "other origin, without credentials. Empty: pages on this machine's localhost only, "
        "without credentials (llama-server's default once its tools are enabled).",
    )
    open_host_controls = models.BooleanField(
        default=False,
        help_text="Let clients reach the hosts' controls through this route: /slots (every "
        "user's prompts), /metrics, /lora-adapters (reading and changing adapter scales), "
        "POST /props and /cors-proxy (which makes a host fetch any URL a client names). Off: "
        "only operators (the CROSSBAR_METRICS_TOKEN bearer, or staff signed in at /admin/).",
    )
    hosts: models.ManyToManyField[Host, RouteHost] = models.ManyToManyField(
        Host, through="RouteHost", related_name="routes"
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class RouteHost(models.Model):
    """A host serving a route, in the order ties are broken."""

    route = models.ForeignKey(Route, on_delete=models.CASCADE, related_name="route_hosts")
    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="route_hosts")
    position = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["route", "position", "id"]
        constraints = [
            models.UniqueConstraint(fields=["route", "host"], name="unique_host_per_route"),
        ]

    def __str__(self) -> str:
        return f"{self.route.name} → {self.host.name}"


class ConfigRevision(models.Model):
    """One row whose stamp changes with every committed configuration change.

    Signals set a new random stamp after each commit; a gateway polls it (cheaply, off the
    request path) to pick up changes made by another process: a second replica, or
    `crossbar_config load` run from a shell while the gateway serves. A random stamp rather
    than a counter: a counter restarts when the row is deleted, and an old value seen again
    would hide a change.
    """

    stamp = models.BigIntegerField(default=0)

    @classmethod
    def current(cls) -> int:
        return cls.objects.filter(pk=1).values_list("stamp", flat=True).first() or 0

    @classmethod
    def bump(cls) -> None:
        stamp = secrets.randbits(62)
        if not cls.objects.filter(pk=1).update(stamp=stamp):
            cls.objects.update_or_create(pk=1, defaults={"stamp": stamp})


class ConfigFileLoad(models.Model):
    """A configuration file loaded into the database: which file, its content, when, what changed.

    `make run` (crossbar_setup) loads its file only when the file's sha256 differs from its last
    load here, so an edit made in the admin is not reverted by the next restart.
    """

    path = models.CharField(max_length=1000, help_text="The file, as an absolute path.")
    sha256 = models.CharField(
        "SHA-256", max_length=64, help_text="The file's content as loaded (hex)."
    )
    loaded = models.DateTimeField(default=timezone.now, db_index=True)
    summary = models.CharField(
        max_length=1000, help_text="What the load changed: “1 host added, 2 models changed”."
    )

    class Meta:
        ordering = ["-loaded", "-pk"]
        verbose_name = "config file load"

    def __str__(self) -> str:
        return f"{self.path} at {self.loaded:%Y-%m-%d %H:%M:%S}"

    @classmethod
    def last_of(cls, path: str) -> ConfigFileLoad | None:
        """The latest load of the file at `path` (absolute), if any."""
        return cls.objects.filter(path=path).order_by("-loaded", "-pk").first()
