"""Admin or ORM edits to hosts, models, routes and client keys reach the running gateway.

Every save or delete, once its transaction commits, bumps this process's generation (an
integer the runtime compares on every request, so admin edits apply at once) and the shared
`ConfigRevision` row (which other processes poll). Receivers run in whatever thread saved,
usually a sync admin thread.
"""

from __future__ import annotations

import threading
from typing import Any

from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.dispatch import receiver

from accounting.models import ClientKey
from hosts.models import Host, HostModel, PlacedModel
from routing.models import ConfigRevision, Route, RouteHost

_lock = threading.Lock()
_generation = 0


def config_generation() -> int:
    """The number of committed configuration changes seen by this process."""
    return _generation


def bump_generation() -> None:
    global _generation
    with _lock:
        _generation += 1


def config_changed() -> None:
    """Tell this process and every other gateway that the configuration changed.

    Call it after bulk writes that bypass model signals (`QuerySet.update`, `bulk_create`).
    """
    bump_generation()
    ConfigRevision.bump()


@receiver(post_save, sender=Host)
@receiver(post_save, sender=HostModel)
@receiver(post_save, sender=Route)
@receiver(post_save, sender=RouteHost)
@receiver(post_save, sender=ClientKey)
@receiver(post_save, sender=PlacedModel)
@receiver(post_delete, sender=Host)
@receiver(post_delete, sender=HostModel)
@receiver(post_delete, sender=Route)
@receiver(post_delete, sender=RouteHost)
@receiver(post_delete, sender=ClientKey)
@receiver(post_delete, sender=PlacedModel)
@receiver(m2m_changed, sender=PlacedModel.hosts.through)
def _config_changed(**kwargs: Any) -> None:
    transaction.on_commit(config_changed, using=kwargs.get("using"))
