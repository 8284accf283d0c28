"""The operator's placement rules reach the fleet configuration the gateway serves: a placed
model's rules by its name, a host's swap budget, residency and memory, the models pinned on it;
and every edit of them is a configuration change."""

from __future__ import annotations

import pytest

from hosts.models import Host, HostModel, PlacedModel
from routing.config.reader import load_fleet
from routing.config.shape import PlacedModelConfig
from routing.core import model_placement
from routing.models import ConfigRevision
from tests.helpers.fleet import add_host

pytestmark = pytest.mark.django_db


@pytest.mark.django_db(transaction=True)  # the reader closes old connections
def test_a_placed_model_reaches_the_fleet_config_with_its_rules() -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080", models={"a": (1, 0)})
    placed = PlacedModel.objects.create(
        name="a", min_loaded=1, max_loaded=2, idle_unload=90, size_gb=7.5
    )
    placed.hosts.set([gpu1])
    PlacedModel.objects.create(name="b")

    fleet = load_fleet()

    assert fleet.placed == {
        "a": PlacedModelConfig("a", 1, 2, frozenset({"gpu1"}), 90.0, 7.5),
        "b": PlacedModelConfig("b", 0, None, None, None, None),
    }


@pytest.mark.django_db(transaction=True)
def test_a_hosts_swap_budget_residency_memory_and_pins_reach_the_fleet_config() -> None:
    add_host("gpu1", "http://10.0.0.5:8080", models={"a": (1, 0), "b": (1, 0)},
             swap_budget=1, min_residency=30, memory_gb=24)  # fmt: skip
    add_host("gpu2", "http://10.0.0.6:8080", models={"a": (1, 0)})
    HostModel.objects.filter(host__name="gpu1", name="b").update(pinned=True)

    hosts = load_fleet().hosts

    gpu1, gpu2 = hosts["gpu1"], hosts["gpu2"]
    assert (gpu1.swap_budget, gpu1.min_residency, gpu1.memory_gb) == (1, 30.0, 24.0)
    assert gpu1.pinned == frozenset({"b"})
    assert (gpu2.swap_budget, gpu2.min_residency, gpu2.memory_gb) == (4, 60.0, None)
    assert gpu2.pinned == frozenset()


def test_a_hosts_defaults_are_placements_own() -> None:
    host = Host(name="gpu1", url="http://10.0.0.5:8080")

    assert host.swap_budget == model_placement.DEFAULT_SWAP_BUDGET
    assert host.min_residency == model_placement.DEFAULT_MIN_RESIDENCY


def test_every_edit_of_a_placed_model_is_a_configuration_change(
    django_capture_on_commit_callbacks,
) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080", models={"a": (1, 0)})
    revisions = [ConfigRevision.current()]

    with django_capture_on_commit_callbacks(execute=True):
        placed = PlacedModel.objects.create(name="a")
    revisions.append(ConfigRevision.current())
    with django_capture_on_commit_callbacks(execute=True):
        placed.hosts.add(gpu1)
    revisions.append(ConfigRevision.current())
    with django_capture_on_commit_callbacks(execute=True):
        placed.delete()
    revisions.append(ConfigRevision.current())

    assert len(set(revisions)) == 4  # each edit a new revision
