"""The route admin: hosts inline in order, and a route judged together with its hosts."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from hosts.models import Host
from routing.models import Route
from tests.helpers.fleet import add_host, add_route
from tests.helpers.route_form import ADD, route_form

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:routing_route_changelist")


def change_url(route: Route) -> str:
    return reverse("admin:routing_route_change", args=[route.pk])


@pytest.fixture
def gpus() -> tuple[Host, Host]:
    return (
        add_host("gpu1", "http://10.0.0.5:8080", models={"llama3": (4, 8)}),
        add_host("gpu2", "http://10.0.0.6:8080", models={"qwen": (2, 0)}),
    )


@pytest.mark.parametrize("url", [CHANGELIST, ADD])
def test_anonymous_users_are_sent_to_the_login_page(client: Client, url: str) -> None:
    response = client.get(url)

    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_the_list_shows_each_route_with_its_hosts_in_order(
    admin_client: Client, gpus: tuple[Host, Host]
) -> None:
    gpu1, gpu2 = gpus
    add_route("chat", [gpu2, gpu1], default_model="llama3", sticky="strict", lease_ttl=600)

    response = admin_client.get(CHANGELIST)

    page = response.content.decode()
    assert response.status_code == 200
    assert "gpu2, gpu1" in page
    assert "strict" in page
    assert "600" in page


def test_the_add_and_change_pages_render(admin_client: Client, gpus: tuple[Host, Host]) -> None:
    route = add_route("chat", list(gpus))

    assert admin_client.get(ADD).status_code == 200
    response = admin_client.get(change_url(route))
    assert response.status_code == 200
    assert b'name="route_hosts-0-position"' in response.content


def test_a_route_is_added_with_its_hosts_in_position_order(
    admin_client: Client, gpus: tuple[Host, Host]
) -> None:
    gpu1, gpu2 = gpus

    response = admin_client.post(ADD, route_form([(2, gpu1), (1, gpu2)]))

    assert response.status_code == 302
    route = Route.objects.get(name="chat")
    assert [rh.host.name for rh in route.route_hosts.all()] == ["gpu2", "gpu1"]


def test_a_default_model_no_host_serves_is_refused(
    admin_client: Client, gpus: tuple[Host, Host]
) -> None:
    gpu1, gpu2 = gpus

    response = admin_client.post(ADD, route_form([(0, gpu2)], default_model="llama3"))

    assert response.status_code == 200
    assert (
        "Default model “llama3” is not served by any of route “chat”&#x27;s hosts: gpu2."
        in response.content.decode()
    )
    assert not Route.objects.exists()


def change_form(route: Route, **fields: object) -> dict[str, object]:
    """The POST of the route's change form as it stands, with `fields` changed."""
    rows = list(route.route_hosts.all())
    data = route_form(
        [(row.position, row.host) for row in rows],
        name=route.name,
        default_model=route.default_model,
        fallback=str(route.fallback_id or ""),
        **{"route_hosts-INITIAL_FORMS": str(len(rows))},
    )
    for index, row in enumerate(rows):
        data[f"route_hosts-{index}-id"] = str(row.pk)
        data[f"route_hosts-{index}-route"] = str(route.pk)
    return {**data, **fields}


def test_removing_the_only_host_serving_the_default_model_is_refused(
    admin_client: Client, gpus: tuple[Host, Host]
) -> None:
    route = add_route("chat", list(gpus), default_model="llama3")

    response = admin_client.post(
        change_url(route), change_form(route, **{"route_hosts-0-DELETE": "on"})
    )

    assert response.status_code == 200
    assert "is not served by any of route" in response.content.decode()
    assert route.route_hosts.count() == 2


def test_a_route_cannot_fall_back_to_itself(admin_client: Client, gpus: tuple[Host, Host]) -> None:
    route = add_route("chat", list(gpus), default_model="llama3")

    response = admin_client.post(change_url(route), change_form(route, fallback=str(route.pk)))

    assert response.status_code == 200
    # The form does not offer the route itself (test_admin_route_form.py); posted anyway:
    assert "Select a valid choice." in response.content.decode()
    route.refresh_from_db()
    assert route.fallback is None


def test_a_fallback_cannot_fall_back_again(admin_client: Client, gpus: tuple[Host, Host]) -> None:
    gpu1, gpu2 = gpus
    cpu = add_route("cpu", [gpu1])
    bulk = add_route("bulk", [gpu2], fallback=cpu)
    chat = add_route("chat", [gpu1], default_model="llama3")

    response = admin_client.post(change_url(chat), change_form(chat, fallback=str(bulk.pk)))

    assert response.status_code == 200
    assert (
        "Route “chat” falls back to route “bulk”, which falls back to “cpu” in turn; "
        "a fallback may not have a fallback of its own."
    ) in response.content.decode()


def test_a_route_others_fall_back_to_may_be_renamed(
    admin_client: Client, gpus: tuple[Host, Host]
) -> None:
    gpu1, gpu2 = gpus
    cpu = add_route("cpu", [gpu2])
    add_route("chat", [gpu1], fallback=cpu)

    response = admin_client.post(change_url(cpu), change_form(cpu, name="cpu-pool"))

    assert response.status_code == 302
    assert Route.objects.get(name="chat").fallback.name == "cpu-pool"  # type: ignore[union-attr]  # saved with one


def test_an_error_the_edit_did_not_make_does_not_block_it(
    admin_client: Client, gpus: tuple[Host, Host]
) -> None:
    route = add_route("chat", [gpus[1]], default_model="llama3")

    response = admin_client.post(
        change_url(route), change_form(route, lease_ttl="600"), follow=True
    )

    route.refresh_from_db()
    assert route.lease_ttl == 600
    messages = [str(message) for message in response.context["messages"]]
    assert "Default model “llama3” is not served by any of route “chat”'s hosts: gpu2." in messages


def test_a_reserved_route_name_is_a_form_error(
    admin_client: Client, gpus: tuple[Host, Host]
) -> None:
    response = admin_client.post(ADD, route_form([(0, gpus[0])], name="admin"))

    assert response.status_code == 200
    assert "is reserved for the gateway&#x27;s own pages" in response.content.decode()
    assert not Route.objects.exists()


def test_a_host_listed_twice_is_a_form_error(admin_client: Client, gpus: tuple[Host, Host]) -> None:
    response = admin_client.post(ADD, route_form([(0, gpus[0]), (1, gpus[0])]))

    assert response.status_code == 200
    assert b"Please correct the duplicate data for host." in response.content
    assert not Route.objects.exists()


def test_a_route_without_hosts_is_saved_with_a_warning(admin_client: Client) -> None:
    response = admin_client.post(ADD, route_form([], default_model=""), follow=True)

    messages = [str(message) for message in response.context["messages"]]
    assert Route.objects.filter(name="chat").exists()
    assert "Route “chat” has no hosts; every request to it will fail." in messages
