"""State changes to hosts that people make while the gateway runs, one function each.

The admin and the live dashboard both call these, so a change means the same thing wherever
it is made. Each saves the rows one by one (not one UPDATE) so the gateway hears of it through
the model signals.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, NamedTuple

import httpx
from django.db import transaction

from hosts.describe import read_host
from hosts.models import Host, HostModel
from hosts.slots import slot_fit


def set_draining(host_names: Iterable[str], on: bool) -> int:
    """Start (`on`) or stop draining the named hosts; return how many changed.

    What a drain does is `hosts.models.DRAINING`. Names of
    hosts that do not exist, or already are in that state, are skipped. Sync: from async code,
    call it through `database_sync_to_async`.
    """
    changed = 0
    with transaction.atomic():
        for host in Host.objects.filter(name__in=list(host_names)).exclude(draining=on):
            host.draining = on
            host.save(update_fields=["draining"])
            changed += 1
    return changed


class Said(NamedTuple):
    """One line an action reports, and how much it matters."""

    level: Literal["success", "warning", "error"]
    text: str


def read_from_host(host: Host) -> list[Said]:
    """Fill the host's models and their `parallel` from what the host says of itself.

    Each model the host lists is added (or kept) with `parallel` = the host's `total_slots`
    when it says one, and the other names it lists for it as its aliases; a configured model
    the host does not list, or lists as another's alias, is left and warned about. Then the
    host's `parallel` is judged against its slots, as `crossbar_config check` does
    (`hosts.slots`): their sum above the slots is an error, below them a warning.
    Returns one line per change, warning or error. Raises `Unreachable` when the host does
    not answer. Blocking I/O: call from a view's thread or a command.
    """
    described = read_host(host.url, host.api_key)
    said: list[Said] = []
    with transaction.atomic():
        configured = {model.name: model for model in host.models.all()}
        for listed, aliases in described.aliases.items():
            said += _read_model(host, configured, (listed, *aliases), described.slots)
        listed_names = set(described.models)
        alias_of = {alias: m.name for m in configured.values() for alias in m.aliases}
        for model in configured.values():
            if model.name in alias_of:
                said.append(
                    Said(
                        "warning",
                        f"{host.name}: {model.name} is now an alias of {alias_of[model.name]}, "
                        "whose slots it shares: delete the model of its own",
                    )
                )
            elif model.name not in listed_names and model.upstream_name not in listed_names:
                said.append(
                    Said(
                        "warning",
                        f"{host.name}: {model.name} is configured; the host does not list it",
                    )
                )
    parallel = {model.name: model.parallel for model in configured.values()}
    if described.slots and (fit := slot_fit(parallel, described.slots)):
        said.append(Said("error" if fit.error else "warning", f"{host.name}: {fit.message}"))
    return said


def _read_model(
    host: Host, configured: dict[str, HostModel], names: tuple[str, ...], slots: int | None
) -> list[Said]:
    """Add or update the model the host lists by `names` (its id, then its aliases): the
    configured model with the first of them as its name or upstream name, else a new one."""
    model = next(  # the one by the id first: the others by an alias are that one's names
        (m for name in names for m in configured.values() if name in (m.name, m.upstream_name)),
        None,
    )
    said = []
    if model is None:
        model = HostModel(host=host, name=names[0])
        if slots:
            model.parallel = slots
        model.save()
        configured[model.name] = model
        said.append(
            Said("success", f"{host.name}: added model {model.name} (parallel {model.parallel})")
        )
    elif slots and model.parallel != slots:
        said.append(
            Said(
                "success",
                f"{host.name}: {model.name} parallel {model.parallel} -> {slots}, the host's slots",
            )
        )
        model.parallel = slots
        model.save(update_fields=["parallel"])
    aliases = [name for name in names if name not in (model.name, model.upstream_name)]
    if list(model.aliases) != aliases:
        said.append(
            Said("success", f"{host.name}: {model.name} aliases {', '.join(aliases) or 'none'}")
        )
        model.aliases = aliases
        model.save(update_fields=["aliases"])
    return said


def manage_models(host: Host, action: str) -> list[str]:
    """Ask a router-mode host to `load` or `unload` each of its configured models
    (`POST /models/load` or `/models/unload`); one line per model saying how it answered.
    A model the host loaded is pinned there: fleet model placement keeps it loaded until it
    is unpinned (`unpin`) or unloaded here, which unpins it first (else placement could load
    it again before the host has unloaded it). Blocking I/O: call from a view's thread or a
    command."""
    if action not in ("load", "unload"):
        raise ValueError(f"action is load or unload, not {action!r}")
    headers = {"Authorization": f"Bearer {host.api_key}"} if host.api_key else {}
    said = []
    with httpx.Client(timeout=10, headers=headers, trust_env=False) as client:
        for model in host.models.all():
            if action == "unload":
                _pin(model, False)
            name = model.upstream_name or model.name
            try:
                url = f"{host.url.rstrip('/')}/models/{action}"
                response = client.post(url, json={"model": name})
            except httpx.HTTPError as exc:
                said.append(f"{host.name}: {action} {name}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code != 200:
                said.append(f"{host.name}: {action} {name}: answered {response.status_code}")
                continue
            if action == "load":
                _pin(model, True)
            pinned = " (pinned: kept loaded until unpinned)" if action == "load" else ""
            said.append(f"{host.name}: {action} {name}: done{pinned}")
    return said


def unpin(host_names: Iterable[str]) -> int:
    """Unpin every model pinned on the named hosts (fleet model placement may unload them
    again, idle or for another model); how many were pinned. Sync."""
    changed = 0
    with transaction.atomic():
        for model in HostModel.objects.filter(host__name__in=list(host_names), pinned=True):
            _pin(model, False)
            changed += 1
    return changed


def _pin(model: HostModel, pinned: bool) -> None:
    # Saved alone, so the gateway hears of it through the model signals.
    if model.pinned != pinned:
        model.pinned = pinned
        model.save(update_fields=["pinned"])
