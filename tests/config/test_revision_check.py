"""The runtime's check of the `ConfigRevision` row (every CROSSBAR_CONFIG_POLL seconds) sees
each change on the connection it keeps, and gets past a connection the database closed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection
from django.db.backends.signals import connection_created

from routing.config.reader import current_revision
from routing.models import ConfigRevision

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def connections_made() -> Iterator[list[object]]:
    made: list[object] = []

    def created(sender: object, **kwargs: object) -> None:
        made.append(kwargs["connection"])

    connection_created.connect(created)
    yield made
    connection_created.disconnect(created)


def test_each_check_reads_the_stamp_of_the_last_change_without_connecting_again(
    connections_made: list[object],
) -> None:
    current_revision()  # the first check connects
    connections_made.clear()
    seen, made = [], []
    for _ in range(3):
        ConfigRevision.bump()
        made.append(ConfigRevision.objects.get(pk=1).stamp)
        seen.append(current_revision())

    assert seen == made
    assert connections_made == []


def test_a_check_whose_kept_connection_the_database_closed_reads_on_a_new_one(
    connections_made: list[object],
) -> None:
    ConfigRevision.bump()
    stamp = ConfigRevision.objects.get(pk=1).stamp
    connections_made.clear()
    assert connection.connection is not None
    connection.connection.close()  # as a database restart or an idle timeout would

    assert current_revision() == stamp
    assert len(connections_made) == 1
