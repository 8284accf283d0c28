"""Admin or ORM edits to hosts, models and routes reach the running gateway.

Every save or delete bumps a generation once its transaction commits; the runtime compares
generations on its own event loop and reloads lazily. Receivers run in whatever thread saved
(usually a sync admin thread), so they only touch an integer under a lock.
"""

from __future__ import annotations

import threading

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from hosts.models import Host, HostModel
from routing.models import Route, RouteHost

_lock = threading.Lock()
_generation = 0


def config_generation() -> int:
    """The number of committed configuration changes seen by this process."""
    return _generation


def bump_generation() -> None:
    global _generation
    with _lock:
        _generation += 1


@receiver(post_save, sender=Host)
@receiver(post_save, sender=HostModel)
@receiver(post_save, sender=Route)
@receiver(post_save, sender=RouteHost)
@receiver(post_delete, sender=Host)
@receiver(post_delete, sender=HostModel)
@receiver(post_delete, sender=Route)
@receiver(post_delete, sender=RouteHost)
def _config_changed(**kwargs: object) -> None:
    transaction.on_commit(bump_generation, using=kwargs.get("using"))  # type: ignore[arg-type]
