"""What a llama-server says of itself: its slots, its models, its context, router mode.

`/props` gives `total_slots` (its `-np`), `model_alias` / `model_path` and
`default_generation_settings.n_ctx`; a router (`--models-dir`, `--models-preset`) says
`role: router`, `max_instances` and `models_autoload` (false when started with
`--no-models-autoload`: it then answers 400 "model is not loaded" for a model it holds
unloaded, rather than loading it). `/v1/models` lists the models (a router adds each one's
`status`: loaded, loading, unloaded, with `failed` when its load failed). Used by the health
poller (which does its own I/O on the event loop), and, through `read_host` (blocking), the
host admin's "Read from host" and `crossbar_config discover`, and through `read_props`,
`crossbar_config check` and `load`, which compare `parallel` with the host's slots.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import httpx

__all__ = [
    "Described",
    "ModelState",
    "Unreachable",
    "describe",
    "read_host",
    "read_props",
    "with_models",
]


class ModelState(enum.StrEnum):
    LOADED = "loaded"
    LOADING = "loading"
    UNLOADED = "unloaded"
    FAILED = "failed"


@dataclass(slots=True, frozen=True)
class Described:
    """A host as it describes itself. None where it did not say."""

    slots: int | None = None
    n_ctx: int | None = None
    model_path: str = ""
    alias: str = ""
    router: bool = False
    max_models: int | None = None  # a router: models loaded at once (`--models-max`)
    autoload: bool | None = None  # a router: loads a model a request names (`--models-autoload`)
    # Each name it answers to (an id, an alias) -> its model's state, in its order.
    models: dict[str, ModelState] = field(default_factory=dict)
    # Each id it lists -> its other names (llama-server's `--alias`), in its order.
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def loaded(self) -> frozenset[str]:
        return frozenset(name for name, state in self.models.items() if state is ModelState.LOADED)


def describe(props: object, models: object) -> Described:
    """Read `/props` and `/v1/models` answers (parsed JSON; anything else counts as silence)."""
    props = props if isinstance(props, dict) else {}
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    router = props.get("role") == "router"
    return Described(
        slots=_count(props.get("total_slots")) if not router else None,
        n_ctx=_count(n_ctx) or None,
        model_path=_text(props.get("model_path")),
        alias=_text(props.get("model_alias")),
        router=router,
        max_models=_count(props.get("max_instances")) if router else None,
        autoload=_flag(props.get("models_autoload")) if router else None,
        models=_model_states(models),
        aliases=_aliases(models),
    )


def with_models(described: Described, models: object) -> Described:
    """`described` with the model states of a newer `/v1/models` answer (a router's change as
    it loads and unloads; its `/props` does not)."""
    return dataclasses.replace(described, models=_model_states(models), aliases=_aliases(models))


def _entries(payload: object) -> list[dict[str, object]]:
    """The entries of a `/v1/models` answer that have an id."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return []
    return [e for e in payload["data"] if isinstance(e, dict) and isinstance(e.get("id"), str)]


def _aliases(payload: object) -> dict[str, tuple[str, ...]]:
    """Each id's other names. llama-server lists the id among its `aliases` (`--alias a,b`
    gives id `a`, aliases `["a", "b"]`); a name listed under an earlier id is that one's."""
    taken: set[str] = set()
    aliases: dict[str, tuple[str, ...]] = {}
    for entry in _entries(payload):
        own = str(entry["id"])
        if own in taken:  # an earlier model's alias: that model's
            continue
        listed = entry.get("aliases")
        names = [n for n in (listed if isinstance(listed, list) else ()) if isinstance(n, str)]
        taken.add(own)
        aliases[own] = tuple(n for n in dict.fromkeys(names) if n not in taken)
        taken.update(aliases[own])
    return aliases


def _model_states(payload: object) -> dict[str, ModelState]:
    states: dict[str, ModelState] = {}
    for entry in _entries(payload):
        status = entry.get("status")
        state = ModelState.LOADED
        if isinstance(status, dict):
            value = status.get("value")
            if status.get("failed") is True:
                state = ModelState.FAILED
            elif value in ("loading", "unloaded"):
                state = ModelState(value)
        states[str(entry["id"])] = state
        aliases = entry.get("aliases")
        for alias in aliases if isinstance(aliases, list) else ():
            if isinstance(alias, str):
                states.setdefault(alias, state)
    return states


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _flag(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _text(value: object) -> str:
    return value if isinstance(value, str) and value != "none" else ""


class Unreachable(Exception):
    """The URL answered nothing usable; the message says what happened, for a person."""


def read_host(url: str, api_key: str = "", timeout: float = 5.0) -> Described:
    """What the host at `url` says of itself. Raises Unreachable."""
    props, models = _read(url, ("/props", "/v1/models"), api_key, timeout)
    described = describe(props, models)
    if not described.models:
        raise Unreachable(f"{url.rstrip('/')}/v1/models lists no model")
    return described


def read_props(url: str, api_key: str = "", timeout: float = 5.0) -> Described:
    """What the host at `url` says of itself in `/props` alone (no models). Raises Unreachable."""
    (props,) = _read(url, ("/props",), api_key, timeout)
    return describe(props, None)


def _read(url: str, paths: tuple[str, ...], api_key: str, timeout: float) -> list[object]:
    """Each path's JSON answer, in order. Raises Unreachable, saying what the host did."""
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    answers: list[object] = []
    with httpx.Client(timeout=timeout, headers=headers, trust_env=False) as client:
        for path in paths:
            try:
                response = client.get(base + path)
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise Unreachable(f"{base}{path}: {type(exc).__name__}: {exc}") from None
            if response.status_code != 200:
                raise Unreachable(f"{base}{path} answered {response.status_code}")
            try:
                answers.append(response.json())
            except ValueError:
                raise Unreachable(f"{base}{path} did not answer JSON") from None
    return answers
