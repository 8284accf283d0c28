"""State changes to hosts that people make while the gateway runs, one function each.

The admin and the live dashboard both call these, so a change means the same thing wherever
it is made. Each saves the rows one by one (not one UPDATE) so the gateway hears of it through
the model signals.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import transaction

from hosts.describe import read_host
from hosts.models import Host, HostModel


def set_draining(host_names: Iterable[str], on: bool) -> int:
    """Start (`on`) or stop draining the named hosts; return how many changed.

    A draining host takes no new conversations and finishes the requests it runs. Names of
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


def read_from_host(host: Host) -> list[str]:
    """Fill the host's models and their `parallel` from what the host says of itself.

    Each model the host lists is added (or kept) with `parallel` = the host's `total_slots`
    when it says one; a configured model the host does not list is left and warned about.
    Returns one line per change or warning. Raises `Unreachable` when the host does not answer.
    Blocking I/O: call from a view's thread or a command.
    """
    described = read_host(host.url, host.api_key)
    said: list[str] = []
    with transaction.atomic():
        configured = {model.name: model for model in host.models.all()}
        for name in described.models:
            model = configured.get(name) or next(
                (m for m in configured.values() if m.upstream_name == name), None
            )
            if model is None:
                model = HostModel(host=host, name=name)
                if described.slots:
                    model.parallel = described.slots
                model.save()
                said.append(f"{host.name}: added model {name} (parallel {model.parallel})")
            elif described.slots and model.parallel != described.slots:
                said.append(
                    f"{host.name}: {model.name} parallel {model.parallel} -> {described.slots}, "
                    "the host's slots"
                )
                model.parallel = described.slots
                model.save(update_fields=["parallel"])
        listed = set(described.models)
        for model in configured.values():
            if model.name not in listed and model.upstream_name not in listed:
                said.append(f"{host.name}: {model.name} is configured; the host does not list it")
    return said
