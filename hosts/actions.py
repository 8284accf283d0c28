"""State changes to hosts that people make while the gateway runs, one function each.

The admin and the live dashboard both call these, so a change means the same thing wherever
it is made. Each saves the rows one by one (not one UPDATE) so the gateway hears of it through
the model signals.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import transaction

from hosts.models import Host


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
