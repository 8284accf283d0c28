"""The engines crossbar sends requests to, and the models each one serves."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

from django import forms
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, URLValidator
from django.db import models

from hosts.address import url_clash


def validate_base_url(value: str) -> None:
    """The engine's base URL, to which the gateway adds llama-server's own paths (`/v1/chat/
    completions`, `/health`): an OpenAI base URL's `/v1` would double them."""
    path = urlsplit(value.strip()).path.rstrip("/")
    if path == "/v1" or path.endswith("/v1"):
        bare = value.strip().rstrip("/").removesuffix("/v1")
        raise ValidationError(
            f"Leave out the /v1: crossbar adds each endpoint's own path (/v1/chat/completions,"
            f" /health), so this URL would send requests to /v1/v1/... Use {bare}."
        )


def validate_weight(value: float) -> None:
    # `not value > 0` also refuses NaN, which TOML can spell.
    if not value > 0 or math.isinf(value):
        raise ValidationError("Weight must be a number greater than 0.")


# What a drain does, said one way wherever it is said: the host form, the admin's and the
# dashboard's messages, the README.
DRAINING = (
    "A draining host takes no new requests: the conversations leased to it move to other hosts "
    "(on a strict route they get 503 pinned_host_down), and the requests it runs finish."
)


# What the gateway does with a host that does not load models on demand, said once: the host
# form and docs/config.md say it.
LOADS_ON_DEMAND = (
    "Whether the host loads a model a request names when it is not loaded (llama-server's "
    "router mode, unless started with --no-models-autoload). A host that does not is sent only "
    "the models it has loaded; a request waits where its model is loaded, or is "
    "refused with model_not_loaded when it is loaded nowhere (load it from this admin's host "
    "list). A llama-server router says which it does in its /props, and its word wins over "
    "this setting, which is for hosts that do not say (a proxy in front, another engine)."
)


MAX_MODEL_NAME = 200  # a model's name, each of its aliases, and Request.model

# Fleet model placement's defaults (`routing.core.model_placement`'s DEFAULT_SWAP_BUDGET and
# DEFAULT_MIN_RESIDENCY, which this app may not import: a test checks they agree).
SWAP_BUDGET = 4
MIN_RESIDENCY = 60.0
_NOT_NEGATIVE = MinValueValidator(0, message="Must be 0 or more.")


def validate_aliases(value: object) -> None:
    """A list of names, none empty, none twice, none longer than a model's name."""
    if not isinstance(value, list | tuple) or not all(isinstance(name, str) for name in value):
        raise ValidationError("Aliases must be a list of names.")
    if any(not name.strip() for name in value):
        raise ValidationError("An alias may not be empty.")
    if long := [name for name in value if len(name) > MAX_MODEL_NAME]:
        raise ValidationError(
            f"Alias “{long[0][:40]}…” is longer than {MAX_MODEL_NAME} characters."
        )
    if twice := sorted({name for name in value if list(value).count(name) > 1}):
        raise ValidationError(f"Alias “{twice[0]}” is listed twice.")


class NamesFormField(forms.CharField):
    """Names separated by commas, as an operator types them (`chat, fast`)."""

    def prepare_value(self, value: object) -> object:
        if isinstance(value, list | tuple):
            return ", ".join(str(name) for name in value)
        return value

    def to_python(self, value: object) -> list[str]:  # type: ignore[override]
        text = super().to_python(value) or ""
        return [name.strip() for name in text.split(",")] if text.strip() else []

    def has_changed(self, initial: object, data: object) -> bool:
        before = list(initial) if isinstance(initial, list | tuple) else []
        return before != self.to_python(data)


class NamesField(models.JSONField):
    """A list of names: a JSON array in the database, names separated by commas in a form."""

    def formfield(self, **kwargs: Any) -> forms.Field | None:  # type: ignore[override]
        # Past JSONField's own, which would show and read JSON.
        return models.Field.formfield(self, **{"form_class": NamesFormField, **kwargs})


class Host(models.Model):
    """One OpenAI-compatible engine (usually a llama-server) behind the gateway."""

    class LoadsOnDemand(models.TextChoices):
        UNKNOWN = "", "Unknown: as the host says (else yes)"
        YES = "yes", "Yes"
        NO = "no", "No"

    name = models.SlugField(
        max_length=64, unique=True, help_text="Shown in headers, logs and rows."
    )
    url = models.CharField(
        "URL",
        max_length=500,
        validators=[URLValidator(schemes=["http", "https"]), validate_base_url],
        help_text="Base URL of the engine, e.g. http://10.0.0.5:8080 (no /v1).",
    )
    shares_url = models.BooleanField(
        "shares URL",
        default=False,
        help_text="Tick only when this URL leads to several boxes (a proxy that fans out) and "
        "other hosts have it too, each with this ticked. Two hosts for one llama-server would "
        "let it run the sum of their parallel at once, more than its slots.",
    )
    weight = models.FloatField(
        default=1.0,
        validators=[validate_weight],
        help_text="Multiplies the host's free slots when a new conversation is placed.",
    )
    enabled = models.BooleanField(default=True)
    loads_on_demand = models.CharField(
        "loads models on demand",
        max_length=7,
        choices=LoadsOnDemand.choices,
        default=LoadsOnDemand.UNKNOWN,
        blank=True,
        help_text=LOADS_ON_DEMAND,
    )
    draining = models.BooleanField(
        default=False,
        help_text=DRAINING,
    )
    api_key = models.CharField(
        "API key",
        max_length=500,
        blank=True,
        help_text="Optional. Sent upstream as a Bearer token.",
    )
    api_key_env = models.CharField(
        "API key's environment variable",
        max_length=200,
        blank=True,
        help_text="The environment variable `crossbar_config load` read the key from, if any.",
    )
    swap_budget = models.PositiveIntegerField(
        "swap budget",
        default=SWAP_BUDGET,
        help_text=f"Fleet model placement begins at most this many model loads on this host in "
        f"any minute, so that alternating demand cannot keep it loading (default {SWAP_BUDGET}). "
        "0: crossbar loads nothing here.",
    )
    min_residency = models.FloatField(
        "minimum residency",
        default=MIN_RESIDENCY,
        validators=[_NOT_NEGATIVE],
        help_text="Seconds a model loaded here stays loaded at least before fleet model "
        f"placement may unload it (idle, or for another model; default {MIN_RESIDENCY:.0f}).",
    )
    memory_gb = models.FloatField(
        "memory (GB)",
        null=True,
        blank=True,
        validators=[_NOT_NEGATIVE],
        help_text="The memory models may take here: fleet model placement loads no model whose "
        "size (a placed model's size_gb) would not fit beside those loaded. Blank: not "
        "counted, only the host's --models-max.",
    )
    notes = models.TextField(blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if self.url:
            self.url = self.url.rstrip("/")
        others = Host.objects.exclude(pk=self.pk) if self.pk else Host.objects.all()
        if clash := url_clash(self, others.only("name", "url", "shares_url")):
            raise ValidationError({"url": clash})

    @property
    def masked_api_key(self) -> str:
        """The key as lists and logs may show it: the last four characters at most."""
        if not self.api_key:
            return ""
        return "…" + self.api_key[-4:] if len(self.api_key) > 8 else "set"


class HostModel(models.Model):
    """A model a host serves, with the slots and queue the gateway allows it."""

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="models")
    name = models.CharField(max_length=200, help_text="What clients send as `model`.")
    upstream_name = models.CharField(
        max_length=200, blank=True, help_text="Optional. Written into the body sent to this host."
    )
    # 4 and 8, as docs/config.md says: with 1 slot and no queue a second concurrent request
    # would be refused at once. Set parallel to the host's real -np.
    parallel = models.PositiveIntegerField(
        default=4,
        validators=[MinValueValidator(1, message="Parallel must be at least 1.")],
        help_text="Requests in flight at once (llama-server's -np).",
    )
    queue_max = models.PositiveIntegerField(
        default=8, help_text="Requests allowed to wait for a slot; more are refused at once."
    )
    aliases = NamesField(
        default=list,
        blank=True,
        validators=[validate_aliases],
        help_text="Other names clients may send for this model (llama-server's --alias), "
        "separated by commas. They share the model's parallel and queue.",
    )
    pinned = models.BooleanField(
        default=False,
        help_text="Loaded by hand from the admin: fleet model placement keeps it loaded on this "
        "host (never unloads it idle, loads it again if it goes) until it is unpinned or "
        "unloaded from the admin.",
    )

    class Meta:
        ordering = ["host__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["host", "name"], name="unique_model_per_host"),
        ]

    def __str__(self) -> str:
        return f"{self.host.name}/{self.name}"


class PlacedModel(models.Model):
    """The operator's rules for one model across the fleet (every host's HostModel of that
    name), read by fleet model placement on router hosts that load no model on demand."""

    name = models.CharField(
        max_length=MAX_MODEL_NAME,
        unique=True,
        help_text="The model's name, as the hosts' models call it (what clients send).",
    )
    min_loaded = models.PositiveIntegerField(
        "minimum loaded",
        default=0,
        help_text="Kept loaded on at least this many hosts, asked for or not (default 0).",
    )
    max_loaded = models.PositiveIntegerField(
        "maximum loaded",
        null=True,
        blank=True,
        help_text="Loaded on at most this many hosts, however long its line. Blank: no limit.",
    )
    hosts = models.ManyToManyField(
        Host,
        blank=True,
        related_name="placed_models",
        help_text="The hosts it may be loaded on. None chosen: any host that lists it.",
    )
    idle_unload = models.FloatField(
        "idle unload",
        null=True,
        blank=True,
        validators=[_NOT_NEGATIVE],
        help_text="Seconds unused before a loaded copy is unloaded (never within its host's "
        "minimum residency). 0: never. Blank: CROSSBAR_MODEL_IDLE_UNLOAD (default 600; 0 "
        "there: never too).",
    )
    size_gb = models.FloatField(
        "size (GB)",
        null=True,
        blank=True,
        validators=[_NOT_NEGATIVE],
        help_text="The memory it takes loaded, counted against the memory of hosts that give "
        "theirs. Blank: not counted (0).",
    )

    class Meta:
        ordering = ["name"]
        verbose_name = "placed model"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        most, least = self.max_loaded, self.min_loaded
        if most is not None and least is not None and least > most:
            raise ValidationError(
                {"max_loaded": f"Maximum loaded ({most}) is below minimum loaded ({least})."}
            )
