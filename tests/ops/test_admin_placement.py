"""Fleet model placement's rules in the admin, signed in as an operator: a placed model's
min_loaded, max_loaded, allowed hosts, idle_unload and size; a host's swap budget, minimum
residency and memory; models pinned by a hand load and unpinned again."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from hosts.models import Host, HostModel, PlacedModel
from routing.models import ConfigRevision
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.admin_hosts import change_url, drain, host_form
from tests.helpers.fleet import add_host

pytestmark = pytest.mark.django_db

ADD_PLACED = reverse("admin:hosts_placedmodel_add")
PLACED_LIST = reverse("admin:hosts_placedmodel_changelist")


@pytest.fixture
def operator() -> Client:
    """A client signed in through the admin's login form, as an operator is."""
    User.objects.create_superuser("ops", "ops@example.com", "a-long-passphrase")
    client = Client()
    response = client.post(
        reverse("admin:login"), {"username": "ops", "password": "a-long-passphrase"}
    )
    assert response.status_code == 302, "the admin login failed"
    return client


def placed_form(**fields: object) -> dict[str, object]:
    data: dict[str, object] = {
        "name": "llama3",
        "min_loaded": "0",
        "max_loaded": "",
        "idle_unload": "",
        "size_gb": "",
    }
    data.update(fields)
    return data


def test_an_operator_places_a_model_with_its_rules_and_the_list_shows_them(
    operator: Client, django_capture_on_commit_callbacks
) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080", models={"llama3": (1, 0)})
    add_host("gpu2", "http://10.0.0.6:8080", models={"llama3": (1, 0)})
    before = ConfigRevision.current()

    with django_capture_on_commit_callbacks(execute=True):
        response = operator.post(
            ADD_PLACED,
            placed_form(
                min_loaded="1", max_loaded="2", hosts=[gpu1.pk], idle_unload="120", size_gb="7.5"
            ),  # fmt: skip
        )
    listed = operator.get(PLACED_LIST).content.decode()

    assert response.status_code == 302
    placed = PlacedModel.objects.get(name="llama3")
    assert (placed.min_loaded, placed.max_loaded, placed.idle_unload, placed.size_gb) == (
        1, 2, 120.0, 7.5,
    )  # fmt: skip
    assert [host.name for host in placed.hosts.all()] == ["gpu1"]
    assert ConfigRevision.current() > before
    assert "llama3" in listed and "gpu1" in listed


def test_the_add_page_says_what_each_rule_does_and_its_default(operator: Client) -> None:
    page = operator.get(ADD_PLACED).content.decode()

    assert "Kept loaded on at least this many hosts, asked for or not (default 0)." in page
    assert "Blank: no limit." in page
    assert "None chosen: any host that lists it." in page
    assert "Blank: CROSSBAR_MODEL_IDLE_UNLOAD (default 600" in page
    assert "Blank: not counted (0)." in page


def test_a_minimum_above_the_maximum_is_refused_with_a_message(operator: Client) -> None:
    response = operator.post(ADD_PLACED, placed_form(min_loaded="2", max_loaded="1"))

    assert response.status_code == 200
    assert "Maximum loaded (1) is below minimum loaded (2)." in response.content.decode()
    assert not PlacedModel.objects.exists()


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("min_loaded", "Ensure this value is greater than or equal to 0."),
        ("max_loaded", "Ensure this value is greater than or equal to 0."),
        ("idle_unload", "Must be 0 or more."),
        ("size_gb", "Must be 0 or more."),
    ],
)
def test_a_negative_rule_is_refused_with_a_message(
    operator: Client, field: str, message: str
) -> None:
    response = operator.post(ADD_PLACED, placed_form(**{field: "-1"}))

    assert response.status_code == 200
    assert message in response.content.decode()
    assert not PlacedModel.objects.exists()


def test_a_hosts_swap_budget_residency_and_memory_are_saved_from_its_form(
    operator: Client,
) -> None:
    response = operator.post(
        reverse("admin:hosts_host_add"),
        host_form([], swap_budget="1", min_residency="30", memory_gb="24"),
    )

    assert response.status_code == 302
    host = Host.objects.get(name="gpu1")
    assert (host.swap_budget, host.min_residency, host.memory_gb) == (1, 30.0, 24.0)


def test_a_new_host_keeps_placements_defaults_and_counts_no_memory(operator: Client) -> None:
    page = operator.get(reverse("admin:hosts_host_add")).content.decode()
    response = operator.post(reverse("admin:hosts_host_add"), host_form([]))

    assert "(default 4)" in page and "default 60)" in page
    assert response.status_code == 302
    host = Host.objects.get(name="gpu1")
    assert (host.swap_budget, host.min_residency, host.memory_gb) == (4, 60.0, None)


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("swap_budget", "Ensure this value is greater than or equal to 0."),
        ("min_residency", "Must be 0 or more."),
        ("memory_gb", "Must be 0 or more."),
    ],
)
def test_a_negative_host_rule_is_refused_with_a_message(
    operator: Client, field: str, message: str
) -> None:
    form = {**host_form([]), field: "-1"}
    response = operator.post(reverse("admin:hosts_host_add"), form)

    assert response.status_code == 200
    assert message in response.content.decode()
    assert not Host.objects.exists()


def test_a_hand_load_pins_the_hosts_models_until_they_are_unpinned(operator: Client) -> None:
    with FakeLlamaServer(router_models=("small", "large"), models_max=2) as router:
        gpu1 = add_host("gpu1", router.url, models={"small": (1, 0), "large": (1, 0)})

        loaded = drain(operator, "load_models", [gpu1])
        pinned = set(HostModel.objects.filter(pinned=True).values_list("name", flat=True))
        page = operator.get(change_url(gpu1)).content.decode()
        unpinned = drain(operator, "unpin_models", [gpu1])

    assert "gpu1: load small: done (pinned: kept loaded until unpinned)" in loaded
    assert pinned == {"small", "large"}
    assert "Pinned" in page
    assert "2 models unpinned" in unpinned
    assert not HostModel.objects.filter(pinned=True).exists()
    assert router.model_status("large") == "loaded"  # unpinned is not unloaded


def test_a_hand_unload_unpins_the_models(operator: Client) -> None:
    with FakeLlamaServer(router_models=("small",)) as router:
        gpu1 = add_host("gpu1", router.url, models={"small": (1, 0)})
        drain(operator, "load_models", [gpu1])

        unloaded = drain(operator, "unload_models", [gpu1])

    assert "gpu1: unload small: done" in unloaded
    assert HostModel.objects.get(name="small").pinned is False


def test_a_load_the_host_refuses_pins_nothing(operator: Client) -> None:
    with FakeLlamaServer(router_models=("small",), failing_models=frozenset({"small"})) as router:
        gpu1 = add_host("gpu1", router.url, models={"small": (1, 0), "absent": (1, 0)})

        said = drain(operator, "load_models", [gpu1])

    assert "gpu1: load absent: answered" in said
    assert HostModel.objects.get(name="absent").pinned is False
