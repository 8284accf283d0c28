"""What the models refuse, in the words a person reads in the admin."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.db import models

from hosts.models import Host, HostModel
from routing.models import Route, RouteHost
from tests.helpers.fleet import add_host, add_route

pytestmark = pytest.mark.django_db


def errors_of(obj: models.Model) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as caught:
        obj.full_clean()
    return caught.value.message_dict


def test_a_host_url_must_be_http_or_https() -> None:
    assert errors_of(Host(name="gpu1", url="ftp://10.0.0.5")) == {"url": ["Enter a valid URL."]}


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_a_host_weight_must_be_a_number_greater_than_zero(weight: float) -> None:
    errors = errors_of(Host(name="gpu1", url="http://10.0.0.5:8080", weight=weight))
    assert errors == {"weight": ["Weight must be a number greater than 0."]}


def test_a_host_url_loses_its_trailing_slash() -> None:
    host = Host(name="gpu1", url="http://10.0.0.5:8080/")
    host.full_clean()
    assert host.url == "http://10.0.0.5:8080"


def test_two_hosts_cannot_share_a_name() -> None:
    add_host("gpu1", "http://10.0.0.5:8080")
    errors = errors_of(Host(name="gpu1", url="http://10.0.0.6:8080"))
    assert errors == {"name": ["Host with this Name already exists."]}


def test_a_model_needs_at_least_one_parallel_slot() -> None:
    host = add_host("gpu1", "http://10.0.0.5:8080")
    errors = errors_of(HostModel(host=host, name="llama3", parallel=0))
    assert errors == {"parallel": ["Parallel must be at least 1."]}


def test_a_model_queue_cannot_be_negative() -> None:
    host = add_host("gpu1", "http://10.0.0.5:8080")
    errors = errors_of(HostModel(host=host, name="llama3", queue_max=-1))
    assert errors == {"queue_max": ["Ensure this value is greater than or equal to 0."]}


def test_a_host_cannot_list_a_model_twice() -> None:
    host = add_host("gpu1", "http://10.0.0.5:8080", models={"llama3": (4, 8)})
    errors = errors_of(HostModel(host=host, name="llama3"))
    assert errors == {"__all__": ["Host model with this Host and Name already exists."]}


@pytest.mark.parametrize("name", ["admin", "v1", "Health"])
def test_a_route_cannot_take_a_name_the_gateway_answers_itself(name: str) -> None:
    errors = errors_of(Route(name=name))
    assert errors == {
        "name": [f"“{name}” is reserved for the gateway's own pages; choose another route name."]
    }


def test_a_route_cannot_list_a_host_twice() -> None:
    host = add_host("gpu1", "http://10.0.0.5:8080")
    route = add_route("chat", [host])
    errors = errors_of(RouteHost(route=route, host=host, position=1))
    assert errors == {"__all__": ["Route host with this Route and Host already exists."]}


def test_a_route_lease_lasts_at_least_a_second() -> None:
    errors = errors_of(Route(name="chat", lease_ttl=0))
    assert errors == {"lease_ttl": ["Ensure this value is greater than or equal to 1."]}


def test_a_masked_api_key_shows_at_most_the_last_four_characters() -> None:
    assert Host(api_key="sk-1234567890abcdef").masked_api_key == "…cdef"
    assert Host(api_key="short").masked_api_key == "set"
    assert Host(api_key="").masked_api_key == ""


@pytest.mark.django_db
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_patience_and_fallback_waits_must_be_finite_seconds(value):
    route = Route(name="chat", lease_patience=value, fallback_after=value)

    with pytest.raises(ValidationError) as raised:
        route.full_clean()

    assert set(raised.value.message_dict) >= {"lease_patience", "fallback_after"}
