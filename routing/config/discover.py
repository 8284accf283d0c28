"""A host's configuration from the host itself: `crossbar_config discover URL` and the host
admin's "Read from host".

Asks the llama-server at a URL for `/props` and `/v1/models` (`hosts.describe` reads them) and
proposes the host as the configuration would hold it: each model it lists (with the other
names it lists for it, llama-server's `--alias`, as its `aliases`), with `parallel` =
its `total_slots` (a router-mode host says no slot count: the default then) and the default
`queue_max`. A host the configuration already has at that address (`hosts.address`) is proposed
under its own name, URL and settings, so loading the proposal updates it rather than adding the
same box a second time. Blocking I/O: call from a management command or an admin view's thread.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.db import models

from hosts.address import address
from hosts.describe import Described, Unreachable, read_host
from hosts.models import HostModel, validate_base_url
from routing.config.shape import ModelConfig
from routing.config.validation import HostSpec

_NOT_A_SLUG = re.compile(r"[^-a-zA-Z0-9_]+")


def discovered(url: str, api_key: str, known: Iterable[HostSpec]) -> HostSpec:
    """The host at `url`, as `proposed_host` makes it from what the host says, under the name of
    the first of `known` at its address. Raises Unreachable, saying why (a URL ending in `/v1`
    gets the admin's words for it: the host answers 404 there, which says nothing)."""
    try:
        validate_base_url(url)
    except ValidationError as invalid:
        raise Unreachable(" ".join(invalid.messages)) from None
    return proposed_host(url, read_host(url, api_key), host_at(url, known))


def proposed_host(url: str, described: Described, known: HostSpec | None = None) -> HostSpec:
    """The host's spec: each model it lists, with the other names it lists for it as its
    aliases, under `known`'s name and settings if given (else a name made from the URL); a
    listed model `known` has (by any of its names) keeps its values but for `parallel`, which
    becomes the host's slots when it says them, and its aliases, the host's."""
    parallel = described.slots or _default("parallel")
    own = {model.name: model for model in known.models} if known else {}
    own |= {model.upstream_name: model for model in own.values() if model.upstream_name}
    models = []
    for listed, aliases in described.aliases.items():
        names = (listed, *aliases)
        mine = next((own[name] for name in names if name in own), None)
        if mine is None:
            mine = ModelConfig(
                name=listed, upstream_name="", parallel=parallel, queue_max=_default("queue_max")
            )
        others = tuple(n for n in names if n not in (mine.name, mine.upstream_name))
        models.append(
            dataclasses.replace(mine, parallel=described.slots or mine.parallel, aliases=others)
        )
    if known is not None:
        return dataclasses.replace(known, models=models, notes=known.notes or _notes(described))
    return HostSpec(
        name=host_name(url),
        url=url.rstrip("/"),
        weight=1.0,
        enabled=True,
        draining=False,
        api_key_env="",
        notes=_notes(described),
        models=models,
    )


def host_at(url: str, hosts: Iterable[HostSpec]) -> HostSpec | None:
    """The first of `hosts` whose URL leads where `url` does (`hosts.address`), if any."""
    here = address(url)
    return next((host for host in hosts if host.url and address(host.url) == here), None)


def host_name(url: str) -> str:
    """A host name (a slug) made from a URL: `http://gpu1:8080` -> `gpu1-8080`."""
    parts = urlsplit(url)
    raw = f"{parts.hostname or 'host'}-{parts.port}" if parts.port else parts.hostname or "host"
    return _NOT_A_SLUG.sub("-", raw).strip("-")[:64] or "host"


def _notes(described: Described) -> str:
    said = []
    if described.router:
        said.append(f"router mode, at most {described.max_models or '?'} models loaded")
    if described.n_ctx:
        said.append(f"n_ctx {described.n_ctx} per slot")
    if described.model_path:
        said.append(described.model_path)
    return "; ".join(said)


def _default(field: str) -> int:
    model_field = HostModel._meta.get_field(field)
    assert isinstance(model_field, models.Field), f"HostModel.{field} is not a plain field"
    return int(model_field.get_default())
