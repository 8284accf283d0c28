"""The fleet as the gateway serves it: hosts with their models, routes, client keys.

Immutable values, built by `routing.config.reader` from the database and swapped whole by the
runtime on a reload. Each is made from the configuration as written (`routing.config.validation`:
`HostSpec`, `RouteSpec`, which the admin, the TOML file and the checks share) by the reader's
`served_host` and `served_route`, the one place a written value becomes a served one (a route's
`sticky` its `strict`, a host's key variable its key). A model is the same written and served.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hosts.address import address
from routing.core.clients import ClientSpec
from routing.core.model_placement import DEFAULT_MIN_RESIDENCY, DEFAULT_SWAP_BUDGET


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """A model a host serves (field names are `HostModel`'s). `aliases` are the other names
    the host answers to for it (llama-server's `--alias`): one model, one pool of slots."""

    name: str
    upstream_name: str
    parallel: int
    queue_max: int
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # The database's JSON gives a list; a tuple compares equal to the file's.
        object.__setattr__(self, "aliases", tuple(self.aliases))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a client may send for it: its own, then its aliases."""
        return (self.name, *self.aliases)


@dataclass(slots=True, frozen=True)
class HostConfig:
    name: str
    url: str
    weight: float
    enabled: bool
    draining: bool
    api_key: str
    models: Mapping[str, ModelConfig]
    # The operator's word on whether the host loads a model a request names that it has not
    # loaded (None: not said). A router's own word (`hosts.describe`) wins over it.
    loads_on_demand: bool | None = None
    # Fleet model placement's rules for this host (`hosts.models.Host`'s help texts say them),
    # and the models loaded here by hand, which placement keeps loaded here.
    swap_budget: int = DEFAULT_SWAP_BUDGET
    min_residency: float = DEFAULT_MIN_RESIDENCY
    memory_gb: float | None = None
    pinned: frozenset[str] = frozenset()


@dataclass(slots=True, frozen=True)
class PlacedModelConfig:
    """The operator's placement rules for one model across the fleet (field names are
    `PlacedModel`'s). `hosts` None: any host that lists it; `idle_unload` None: the gateway's
    CROSSBAR_MODEL_IDLE_UNLOAD; `size_gb` None: not counted."""

    name: str
    min_loaded: int = 0
    max_loaded: int | None = None
    hosts: frozenset[str] | None = None
    idle_unload: float | None = None
    size_gb: float | None = None


@dataclass(slots=True, frozen=True)
class RouteConfig:
    name: str
    default_model: str
    lease_ttl: float
    strict: bool
    enabled: bool
    hosts: tuple[str, ...]
    wait_status: bool = False
    queue_timeout: float = 300.0
    lease_patience: float | None = None  # seconds; None: auto (routing/core/patience.py)
    fallback: str = ""  # a route name
    fallback_after: float = 10.0
    fallback_model: str = ""
    pass_credentials: bool = False
    map_unknown_models: bool = False
    manage_models: bool = False
    cors_origins: frozenset[str] = frozenset()  # lower-cased; routing.core.cors
    open_host_controls: bool = False


@dataclass(slots=True, frozen=True)
class FleetConfig:
    """The configuration as one frozen value: hosts, routes and client keys at one revision
    (the live fleet as placement sees it is `routing.core.placement.Fleet`)."""

    hosts: Mapping[str, HostConfig]
    routes: Mapping[str, RouteConfig]
    revision: int
    clients: Mapping[str, ClientSpec] = field(default_factory=dict)  # enabled keys by sha256
    placed: Mapping[str, PlacedModelConfig] = field(default_factory=dict)  # by model name

    def route_models(self, route: RouteConfig) -> list[str]:
        """Every model some enabled host of the route serves, in route order."""
        seen: dict[str, None] = {}
        for name in route.hosts:
            host = self.hosts.get(name)
            if host is not None and host.enabled:
                seen.update(dict.fromkeys(host.models))
        return list(seen)

    def route_names(self, route: RouteConfig) -> dict[str, str]:
        """Every name the route's enabled hosts serve a model by (its own, its aliases), each
        to the model's name. A model's own name wins over another's alias, and the first host
        over the next (validation refuses both clashes)."""
        names = {name: name for name in self.route_models(route)}
        for name in route.hosts:
            host = self.hosts.get(name)
            if host is not None and host.enabled:
                for model in host.models.values():
                    for alias in model.aliases:
                        names.setdefault(alias, model.name)
        return names


def renamed_hosts(old: FleetConfig, new: FleetConfig) -> dict[str, str]:
    """The hosts of `old` that `new` calls by another name: old name -> new name.

    A host is the box its URL leads to (`hosts.address`, the rule that keeps one host per
    box): a host gone from `new` whose address exactly one host new in `new` has, and no other
    host gone, is that host renamed (in the admin, or a file that renames it, which deletes the
    row and adds another). Its requests running there still run there, so the box's count of
    them must follow the name (`FleetState.rename`)."""
    gone: dict[str, list[str]] = {}
    for name, host in old.hosts.items():
        if name not in new.hosts:
            gone.setdefault(address(host.url), []).append(name)
    added: dict[str, list[str]] = {}
    for name, host in new.hosts.items():
        if name not in old.hosts:
            added.setdefault(address(host.url), []).append(name)
    return {
        was[0]: now[0]
        for where, was in gone.items()
        if len(was) == 1 and len(now := added.get(where, [])) == 1
    }
