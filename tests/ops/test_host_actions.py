"""Host actions: the one place a drain changes, for the admin and the dashboard alike."""

from __future__ import annotations

import pytest

from hosts.actions import set_draining
from hosts.models import Host
from routing import signals
from tests.helpers.fleet import add_host

pytestmark = pytest.mark.django_db(transaction=True)


def test_set_draining_changes_only_hosts_not_yet_in_that_state_and_counts_them():
    add_host("gpu1", "http://10.0.0.5:8080")
    add_host("gpu2", "http://10.0.0.6:8080", draining=True)
    add_host("gpu3", "http://10.0.0.7:8080")

    changed = set_draining(["gpu1", "gpu2", "no-such-host"], True)

    assert changed == 1
    assert dict(Host.objects.values_list("name", "draining")) == {
        "gpu1": True,
        "gpu2": True,
        "gpu3": False,
    }


def test_set_draining_tells_the_gateway_once_the_change_is_committed():
    add_host("gpu1", "http://10.0.0.5:8080")
    before = signals.config_generation()

    assert set_draining(["gpu1"], True) == 1
    assert signals.config_generation() > before
    generation = signals.config_generation()
    assert set_draining(["gpu1"], True) == 0
    assert signals.config_generation() == generation
