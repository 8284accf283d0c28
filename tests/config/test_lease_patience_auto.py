"""`lease_patience = "auto"`: the default for new routes, in the file, the admin's model, the
diff of a load and the served route; a number keeps the fixed wait."""

from __future__ import annotations

import pytest

from routing.config.diff import config_diff
from routing.config.reader import served_route
from routing.config.toml import dump_config, parse_config
from routing.config.validation import config_problems
from routing.models import Route
from tests.helpers.config_file import crossbar_config, write
from tests.helpers.fleet import add_host
from tests.helpers.route_form import ADD, route_form

ROUTES = """
[[hosts]]
name = "gpu1"
url = "http://10.0.0.5:8080"
  [[hosts.models]]
  name = "llama3"

[[routes]]
name = "left-out"
hosts = ["gpu1"]

[[routes]]
name = "auto"
lease_patience = "auto"
hosts = ["gpu1"]

[[routes]]
name = "fixed"
lease_patience = 2
hosts = ["gpu1"]
"""


def test_a_file_reads_auto_or_a_number_and_auto_is_what_a_route_leaving_it_out_gets() -> None:
    hosts, routes, problems = parse_config(ROUTES)

    assert problems == []
    assert [route.lease_patience for route in routes] == [None, None, 2.0]
    assert config_problems(hosts, routes) == []
    assert [served_route(route).lease_patience for route in routes] == [None, None, 2.0]


def test_auto_is_written_as_auto_and_reads_back_the_same() -> None:
    hosts, routes, _ = parse_config(ROUTES)

    written = dump_config(hosts, routes)

    assert 'lease_patience = "auto"' in written
    assert "lease_patience = 2.0" in written
    assert parse_config(written)[1] == routes


def test_a_word_other_than_auto_is_a_file_problem_that_says_what_it_takes() -> None:
    _, [route], problems = parse_config('[[routes]]\nname = "r"\nlease_patience = "soon"\n')

    assert [str(problem) for problem in problems] == [
        'error: routes.r.lease_patience: Expected a number or "auto".'
    ]
    assert route.lease_patience is None  # the default stands in, as for any wrong type


def test_a_negative_patience_is_still_refused() -> None:
    hosts, _, _ = parse_config(ROUTES)
    _, routes, _ = parse_config('[[routes]]\nname = "r"\nlease_patience = -1\nhosts = ["gpu1"]\n')

    assert [problem.key for problem in config_problems(hosts, routes)] == [
        "routes.r.lease_patience"
    ]


def test_a_load_that_turns_a_fixed_patience_to_auto_says_so() -> None:
    hosts, [_, _, fixed], _ = parse_config(ROUTES)
    _, [_, auto, _], _ = parse_config(ROUTES)
    auto.name = fixed.name

    [change] = config_diff((hosts, [fixed]), hosts, [auto], prune=False)

    assert str(change) == 'change route fixed: lease_patience 2.0 -> "auto"'


@pytest.mark.django_db
def test_a_new_route_is_auto_and_an_existing_one_keeps_its_number(tmp_path) -> None:
    Route.objects.create(name="older", lease_patience=2.0)
    new = Route.objects.create(name="newer")

    crossbar_config("load", write(tmp_path, ROUTES))

    assert new.lease_patience is None
    assert dict(Route.objects.values_list("name", "lease_patience")) == {
        "older": 2.0,
        "newer": None,
        "left-out": None,
        "auto": None,
        "fixed": 2.0,
    }
    new.full_clean()  # blank is valid: the admin's form takes an empty field as auto


@pytest.mark.django_db
@pytest.mark.parametrize(("given", "saved"), [("", None), ("0.5", 0.5)])
def test_the_admin_saves_a_blank_patience_as_auto_and_a_number_as_it_is(
    admin_client, given: str, saved: float | None
) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080", models={"llama3": (4, 8)})

    response = admin_client.post(ADD, route_form([(0, gpu1)], lease_patience=given))

    assert response.status_code == 302, response.content.decode()[:2000]
    assert Route.objects.get(name="chat").lease_patience == saved
    page = admin_client.get(ADD).content.decode()
    assert "Empty: auto" in page  # the field says what blank means
