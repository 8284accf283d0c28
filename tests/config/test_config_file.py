"""crossbar_config: the fleet loaded from, dumped to and checked as TOML."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management.base import CommandError

from hosts.models import Host, HostModel
from routing.config.shape import ModelConfig
from routing.config.toml import dump_config, parse_config
from routing.config.validation import HostSpec, RouteSpec, config_problems
from routing.models import Route
from tests.helpers.config_file import crossbar_config, write
from tests.helpers.fleet import add_host, add_route

ROOT = Path(__file__).resolve().parent.parent.parent

FLEET = """
[[hosts]]
name = "gpu1"
url = "http://10.0.0.5:8080/"
weight = 2
notes = "two cards"
  [[hosts.models]]
  name = "llama3"
  parallel = 4
  queue_max = 8
  [[hosts.models]]
  name = "qwen"
  upstream_name = "Qwen2.5-7B-Instruct"
  parallel = 2
  queue_max = 0

[[hosts]]
name = "gpu2"
url = "http://10.0.0.6:8080"
draining = true
api_key_env = "GPU2_KEY"
  [[hosts.models]]
  name = "llama3"
  parallel = 2
  queue_max = 4

[[routes]]
name = "chat"
default_model = "llama3"
lease_ttl = 600
sticky = "strict"
hosts = ["gpu2", "gpu1"]
"""


# Its hosts are made up: nothing would answer there.
pytestmark = pytest.mark.usefixtures("hosts_not_asked", "gpu2_key")


def fleet_rows() -> tuple[list[tuple], list[tuple], list[tuple]]:
    """Every configuration row, to compare the database before and after."""
    return (
        list(Host.objects.values_list()),
        list(HostModel.objects.values_list()),
        list(Route.objects.values_list("name", "default_model", "route_hosts__host__name")),
    )


@pytest.mark.django_db
def test_load_creates_hosts_models_and_routes_in_file_order(tmp_path: Path) -> None:
    path = write(tmp_path, FLEET)

    summary = crossbar_config("load", path)

    assert summary == f"loaded {path}: 2 hosts added, 3 models added, 1 route added"
    gpu1 = Host.objects.get(name="gpu1")
    assert (gpu1.url, gpu1.weight, gpu1.notes) == ("http://10.0.0.5:8080", 2.0, "two cards")
    qwen = gpu1.models.get(name="qwen")
    assert (qwen.upstream_name, qwen.parallel, qwen.queue_max) == ("Qwen2.5-7B-Instruct", 2, 0)
    route = Route.objects.get(name="chat")
    assert (route.default_model, route.lease_ttl, route.sticky) == ("llama3", 600, "strict")
    assert [rh.host.name for rh in route.route_hosts.all()] == ["gpu2", "gpu1"]


@pytest.mark.django_db
def test_loading_the_same_file_again_changes_nothing(tmp_path: Path) -> None:
    path = write(tmp_path, FLEET)
    crossbar_config("load", path)

    assert crossbar_config("load", path) == f"loaded {path}: nothing changed"


@pytest.mark.django_db
def test_a_load_of_a_file_that_dropped_a_host_says_the_host_stays(tmp_path: Path) -> None:
    spare = '[[hosts]]\nname = "spare"\nurl = "http://10.0.0.9:8080"\n'
    crossbar_config("load", write(tmp_path, spare + FLEET))

    said = crossbar_config("load", write(tmp_path, FLEET)).splitlines()

    assert said == [
        f"loaded {tmp_path / 'fleet.toml'}: nothing changed",
        "kept what the file does not name (--prune removes it): host spare",
    ]
    assert Host.objects.filter(name="spare").exists()


@pytest.mark.django_db
def test_load_updates_by_name_and_keeps_what_the_file_leaves_out(tmp_path: Path) -> None:
    spare = add_host("spare", "http://10.0.0.9:8080", models={"llama3": (1, 0)})
    add_route("batch", [spare], default_model="llama3")
    add_host("gpu1", "http://10.0.0.1:8080", models={"mistral": (1, 0)})

    summary, kept = crossbar_config("load", write(tmp_path, FLEET)).splitlines()

    assert summary.endswith(": 1 host added, 1 host changed, 3 models added, 1 route added")
    assert kept == (
        "kept what the file does not name (--prune removes it): model gpu1/mistral, host spare, "
        "route batch"
    )
    assert Host.objects.get(name="gpu1").url == "http://10.0.0.5:8080"
    assert set(Host.objects.values_list("name", flat=True)) == {"gpu1", "gpu2", "spare"}
    assert set(HostModel.objects.filter(host__name="gpu1").values_list("name", flat=True)) == {
        "llama3",
        "mistral",
        "qwen",
    }
    assert Route.objects.filter(name="batch").exists()


@pytest.mark.django_db
def test_prune_deletes_the_hosts_models_and_routes_the_file_does_not_name(tmp_path: Path) -> None:
    spare = add_host("spare", "http://10.0.0.9:8080", models={"llama3": (1, 0)})
    add_route("batch", [spare], default_model="llama3")
    add_host("gpu1", "http://10.0.0.1:8080", models={"mistral": (1, 0)})

    summary = crossbar_config("load", "--prune", write(tmp_path, FLEET))

    assert summary.endswith(
        ": 1 host added, 1 host changed, 1 host removed, 3 models added, 2 models removed, "
        "1 route added, 1 route removed"
    )
    assert set(Host.objects.values_list("name", flat=True)) == {"gpu1", "gpu2"}
    assert set(HostModel.objects.filter(host__name="gpu1").values_list("name", flat=True)) == {
        "llama3",
        "qwen",
    }
    assert list(Route.objects.values_list("name", flat=True)) == ["chat"]


@pytest.mark.django_db
def test_load_replaces_a_routes_hosts_with_the_files_list_in_its_order(tmp_path: Path) -> None:
    path = write(tmp_path, FLEET)
    crossbar_config("load", path)

    crossbar_config("load", write(tmp_path, FLEET.replace('["gpu2", "gpu1"]', '["gpu1"]')))

    route = Route.objects.get(name="chat")
    assert [rh.host.name for rh in route.route_hosts.all()] == ["gpu1"]


@pytest.mark.django_db
def test_dump_round_trips_through_an_empty_database(tmp_path: Path) -> None:
    crossbar_config("load", write(tmp_path, FLEET))
    first = crossbar_config("dump")

    Route.objects.all().delete()
    Host.objects.all().delete()
    crossbar_config("load", write(tmp_path, first, "dump.toml"))

    assert crossbar_config("dump") == first
    assert parse_config(first)[2] == []


@pytest.mark.django_db
def test_dump_names_the_key_variable_and_never_prints_a_key(tmp_path: Path, gpu2_key: str) -> None:
    crossbar_config("load", write(tmp_path, FLEET))
    Host.objects.filter(name="gpu1").update(api_key="sk-admin-typed-abcdef")

    dump = crossbar_config("dump")

    assert Host.objects.get(name="gpu2").api_key == gpu2_key
    assert 'api_key_env = "GPU2_KEY"' in dump
    assert "# An API key set in the admin is not exported" in dump
    assert gpu2_key not in dump
    assert "sk-admin-typed-abcdef" not in dump


@pytest.mark.django_db
def test_a_key_set_in_the_admin_survives_a_load(tmp_path: Path) -> None:
    path = write(tmp_path, FLEET)
    crossbar_config("load", path)
    Host.objects.filter(name="gpu1").update(api_key="sk-admin-typed-abcdef")

    crossbar_config("load", path)

    assert Host.objects.get(name="gpu1").api_key == "sk-admin-typed-abcdef"


@pytest.mark.django_db
def test_a_key_the_file_brought_in_goes_when_the_file_drops_api_key_env(tmp_path: Path) -> None:
    crossbar_config("load", write(tmp_path, FLEET))

    crossbar_config("load", write(tmp_path, FLEET.replace('api_key_env = "GPU2_KEY"', "")))

    gpu2 = Host.objects.get(name="gpu2")
    assert (gpu2.api_key, gpu2.api_key_env) == ("", "")


@pytest.mark.django_db
def test_an_unset_key_variable_refuses_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPU2_KEY")

    with pytest.raises(CommandError) as caught:
        crossbar_config("load", write(tmp_path, FLEET))

    assert "hosts.gpu2.api_key_env: Environment variable GPU2_KEY is not set." in str(caught.value)
    assert not Host.objects.exists()


@pytest.mark.django_db
def test_a_bad_file_changes_nothing_and_names_each_key(tmp_path: Path) -> None:
    crossbar_config("load", write(tmp_path, FLEET))
    before = fleet_rows()
    bad = (
        FLEET.replace('url = "http://10.0.0.6:8080"', 'url = "ftp://10.0.0.6"')
        .replace("parallel = 2\n  queue_max = 4", "parallel = 0\n  queue_max = 4")
        .replace('default_model = "llama3"', 'default_model = "mistral"')
        .replace("weight = 2", "weight = 3")
    )

    with pytest.raises(CommandError) as caught:
        crossbar_config("load", write(tmp_path, bad, "bad.toml"))

    message = str(caught.value)
    assert caught.value.returncode == 1
    assert "bad.toml: nothing was changed; 3 errors, 0 warnings:" in message
    assert "error: hosts.gpu2.url: Enter a valid URL." in message
    assert "error: hosts.gpu2.models.llama3.parallel: Parallel must be at least 1." in message
    assert (
        "error: routes.chat.default_model: Default model “mistral” is not served by any of "
        "route “chat”'s hosts: gpu2, gpu1."
    ) in message
    assert fleet_rows() == before


@pytest.mark.django_db
def test_a_route_may_name_a_host_the_database_already_has(tmp_path: Path) -> None:
    add_host("spare", "http://10.0.0.9:8080", models={"llama3": (1, 0)})
    text = '[[routes]]\nname = "batch"\ndefault_model = "llama3"\nhosts = ["spare"]\n'

    summary, kept = crossbar_config("load", write(tmp_path, text)).splitlines()
    assert summary.endswith(": 1 route added") and kept.endswith(": host spare")


@pytest.mark.django_db
def test_prune_refuses_a_route_naming_a_host_it_would_delete(tmp_path: Path) -> None:
    add_host("spare", "http://10.0.0.9:8080", models={"llama3": (1, 0)})
    text = '[[routes]]\nname = "batch"\nhosts = ["spare"]\n'

    with pytest.raises(CommandError, match=r"routes\.batch\.hosts: Route “batch” names host"):
        crossbar_config("load", "--prune", write(tmp_path, text))

    assert Host.objects.filter(name="spare").exists()


@pytest.mark.django_db
def test_a_file_that_is_not_toml_is_refused_with_its_line(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match=r"is not valid TOML: .*line 2"):
        crossbar_config("load", write(tmp_path, '[[hosts]]\nname = "gpu1\n'))


def test_a_missing_file_is_refused_without_a_traceback() -> None:
    with pytest.raises(CommandError, match="Cannot read /nonexistent/fleet.toml"):
        crossbar_config("check", "/nonexistent/fleet.toml")


def test_wrong_types_unknown_keys_and_literal_keys_are_file_problems() -> None:
    text = """
[[hosts]]
name = "gpu1"
url = "http://10.0.0.5:8080"
enabled = "yes"
api_key = "sk-in-the-file"
colour = "blue"
  [[hosts.models]]
  name = "llama3"
  parallel = 1.5
  queue_max = true

[[routes]]
name = "chat"
hosts = "gpu1"
"""
    hosts, routes, problems = parse_config(text)

    assert [(p.key, p.message) for p in problems] == [
        (
            "hosts.gpu1.api_key",
            "API keys are not read from the file: put the key in an environment variable and "
            "name the variable in api_key_env.",
        ),
        (
            "hosts.gpu1.colour",
            "Unknown key; expected one of api_key_env, draining, enabled, loads_on_demand, "
            "models, name, notes, shares_url, url, weight.",
        ),
        ("hosts.gpu1.enabled", "Expected true or false."),
        ("hosts.gpu1.models.llama3.parallel", "Expected an integer."),
        ("hosts.gpu1.models.llama3.queue_max", "Expected an integer."),
        ("routes.chat.hosts", "Expected a list of host names."),
    ]
    expected = ModelConfig(name="llama3", upstream_name="", parallel=4, queue_max=8)
    assert hosts[0].models[0] == expected


def test_an_unknown_key_close_to_a_known_one_is_named_with_the_known_keys() -> None:
    text = """
[[hosts]]
name = "gpu1"
url = "http://10.0.0.5:8080"
  [[hosts.models]]
  name = "llama3"
  paralel = 4

[[routes]]
name = "chat"
hosts = ["gpu1"]
default_modle = "llama3"
"""
    _, _, (model, route) = parse_config(text)

    assert (model.key, model.message) == (
        "hosts.gpu1.models.llama3.paralel",
        "Unknown key; did you mean parallel? Expected one of aliases, name, parallel, "
        "queue_max, upstream_name.",
    )
    assert route.key == "routes.chat.default_modle"
    assert route.message.startswith(
        "Unknown key; did you mean default_model? Expected one of cors_origins, default_model, "
    )


def test_a_nameless_entry_is_called_by_its_position() -> None:
    hosts, routes, problems = parse_config('[[hosts]]\nurl = "http://10.0.0.5:8080"\n')

    assert [str(p) for p in problems + config_problems(hosts, routes)] == [
        "error: hosts[0].name: This field cannot be blank."
    ]


def gpu(name: str, *models: str) -> HostSpec:
    host_models = [ModelConfig(name=m, upstream_name="", parallel=1, queue_max=0) for m in models]
    return HostSpec(
        name=name,
        url=f"http://{name}.lan:8080",
        weight=1.0,
        enabled=True,
        draining=False,
        api_key_env="",
        notes="",
        models=host_models,
    )


def route(
    name: str, default_model: str, *hosts: str, fallback: str = "", fallback_model: str = ""
) -> RouteSpec:
    spec = RouteSpec.from_route(Route(name=name, default_model=default_model), list(hosts))
    spec.fallback = fallback
    spec.fallback_model = fallback_model
    return spec


def test_config_problems_names_duplicates_unknown_hosts_and_hostless_routes() -> None:
    hosts = [gpu("gpu1", "llama3", "llama3"), gpu("gpu1", "qwen")]
    routes = [route("chat", "", "gpu1", "gpu9", "gpu1"), route("idle", ""), route("idle", "")]

    problems = config_problems(hosts, routes)

    assert [(p.code, p.key, p.message) for p in problems] == [
        ("E002", "hosts.gpu1.name", "Host name “gpu1” is used 2 times."),
        ("E002", "hosts.gpu1.models.llama3.name", "Model name “llama3” is used 2 times."),
        ("E002", "routes.idle.name", "Route name “idle” is used 2 times."),
        ("E003", "routes.chat.hosts", "Route “chat” names host “gpu9”, which does not exist."),
        ("E002", "routes.chat.hosts", "Host “gpu1” is listed 2 times."),
        ("W001", "routes.idle.hosts", "Route “idle” has no hosts; every request to it will fail."),
        ("W001", "routes.idle.hosts", "Route “idle” has no hosts; every request to it will fail."),
    ]
    assert [p.is_error for p in problems] == [True] * 5 + [False] * 2


def test_a_default_model_must_be_served_by_one_of_the_routes_hosts() -> None:
    hosts = [gpu("a", "qwen"), gpu("b", "mistral"), gpu("c", "x")]

    assert [str(p) for p in config_problems(hosts, [route("chat", "x", "a", "b")])] == [
        "error: routes.chat.default_model: Default model “x” is not served by any of route "
        "“chat”'s hosts: a, b."
    ]
    assert config_problems(hosts, [route("chat", "x", "a", "c")]) == []


def test_keys_quote_names_that_are_not_bare_toml_keys() -> None:
    hosts = [gpu("gpu1")]
    hosts[0].models = [ModelConfig(name="llama-3.1", upstream_name="", parallel=0, queue_max=0)]

    assert [p.key for p in config_problems(hosts, [])] == ['hosts.gpu1.models."llama-3.1".parallel']


@pytest.mark.django_db
def test_check_exits_non_zero_when_the_database_has_errors() -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080", models={"qwen": (1, 0)})
    add_route("chat", [gpu1], default_model="llama3")

    with pytest.raises(CommandError) as caught:
        crossbar_config("check")

    assert caught.value.returncode == 1
    assert str(caught.value).startswith("the database; 1 error, 0 warnings:")


@pytest.mark.django_db
def test_check_passes_with_warnings_only() -> None:
    add_route("idle", [])

    assert crossbar_config("check") == (
        "warning: routes.idle.hosts: Route “idle” has no hosts; every request to it will fail.\n"
        "the database: 0 errors, 1 warning"
    )


def test_check_refuses_a_host_url_ending_in_v1_and_says_what_to_write(tmp_path: Path) -> None:
    openai_style = FLEET.replace('url = "http://10.0.0.6:8080"', 'url = "http://10.0.0.6:8080/v1"')

    with pytest.raises(CommandError) as caught:
        crossbar_config("check", write(tmp_path, openai_style))

    assert "error: hosts.gpu2.url: Leave out the /v1" in str(caught.value)
    assert "Use http://10.0.0.6:8080." in str(caught.value)


def test_check_judges_a_file_on_its_own(tmp_path: Path) -> None:
    assert crossbar_config("check", write(tmp_path, FLEET)).endswith(": 0 errors, 0 warnings")

    with pytest.raises(CommandError, match=r"routes\.chat\.hosts: Route “chat” names host “gpu9”"):
        crossbar_config("check", write(tmp_path, FLEET.replace('"gpu1"]', '"gpu9"]')))


@pytest.mark.django_db
def test_the_example_file_loads_as_it_ships() -> None:
    summary = crossbar_config("load", str(ROOT / "crossbar.example.toml"))

    assert summary.endswith(": 2 hosts added, 2 models added, 1 route added")


WITH_FALLBACK = FLEET.replace('sticky = "strict"', 'sticky = "strict"\nfallback = "cpu"') + (
    '\n[[routes]]\nname = "cpu"\ndefault_model = "qwen"\nqueue_timeout = 60\nhosts = ["gpu1"]\n'
)


@pytest.mark.django_db
def test_a_fallback_may_be_a_route_further_down_the_file(tmp_path: Path) -> None:
    summary = crossbar_config("load", write(tmp_path, WITH_FALLBACK))

    assert summary.endswith(": 2 hosts added, 3 models added, 2 routes added")
    assert Route.objects.get(name="chat").fallback == Route.objects.get(name="cpu")
    assert Route.objects.get(name="cpu").queue_timeout == 60


@pytest.mark.django_db
def test_dump_round_trips_fallbacks(tmp_path: Path) -> None:
    crossbar_config("load", write(tmp_path, WITH_FALLBACK))
    first = crossbar_config("dump")

    Route.objects.all().delete()
    crossbar_config("load", write(tmp_path, first, "dump.toml"))

    assert 'fallback = "cpu"' in first
    assert crossbar_config("dump") == first


@pytest.mark.django_db
def test_dropping_the_fallback_from_the_file_removes_it(tmp_path: Path) -> None:
    crossbar_config("load", write(tmp_path, WITH_FALLBACK))

    summary = crossbar_config(
        "load", write(tmp_path, WITH_FALLBACK.replace('fallback = "cpu"', ""))
    )

    assert summary.endswith(": 1 route changed")
    assert Route.objects.get(name="chat").fallback is None


def test_a_fallback_must_be_another_route_without_a_fallback_of_its_own() -> None:
    hosts = [gpu("a", "x")]
    routes = [
        route("chat", "", "a", fallback="bulk"),
        route("bulk", "", "a", fallback="cpu"),
        route("cpu", "", "a", fallback="cpu"),
        route("spare", "", "a", fallback="nowhere"),
    ]

    assert [(p.code, p.key, p.message) for p in config_problems(hosts, routes)] == [
        (
            "E006",
            "routes.chat.fallback",
            "Route “chat” falls back to route “bulk”, which falls back to “cpu” in turn; "
            "a fallback may not have a fallback of its own.",
        ),
        (
            "E006",
            "routes.bulk.fallback",
            "Route “bulk” falls back to route “cpu”, which falls back to “cpu” in turn; "
            "a fallback may not have a fallback of its own.",
        ),
        ("E006", "routes.cpu.fallback", "Route “cpu” cannot fall back to itself."),
        (
            "E005",
            "routes.spare.fallback",
            "Route “spare” falls back to route “nowhere”, which does not exist.",
        ),
    ]


def test_a_fallback_model_must_be_served_by_the_fallback_routes_hosts() -> None:
    hosts = [gpu("a", "llama"), gpu("b", "small")]
    routes = [
        route("chat", "", "a", fallback="cpu", fallback_model="tiny"),
        route("code", "", "a", fallback="cpu", fallback_model="small"),
        route("cpu", "", "b"),
    ]

    assert [(p.code, p.key, p.message) for p in config_problems(hosts, routes)] == [
        (
            "E007",
            "routes.chat.fallback_model",
            "Fallback model “tiny” is not served by any of route “cpu”'s hosts: b.",
        )
    ]


ALIASES = """
[[hosts]]
name = "gpu1"
url = "http://10.0.0.5:8080"
  [[hosts.models]]
  name = "qwen"
  aliases = ["chat", "fast"]

[[hosts]]
name = "gpu2"
url = "http://10.0.0.6:8080"
  [[hosts.models]]
  name = "qwen"
  aliases = ["chat"]
  [[hosts.models]]
  name = "fast"

[[routes]]
name = "chat"
hosts = ["gpu1", "gpu2"]
"""


def test_aliases_load_dump_and_are_refused_only_where_a_route_would_serve_two_models_by_one(
    tmp_path: Path,
) -> None:
    hosts, routes, problems = parse_config(ALIASES)

    found = [str(p) for p in config_problems(hosts, routes)]

    assert problems == []
    assert [m.aliases for h in hosts for m in h.models] == [("chat", "fast"), ("chat",), ()]
    assert found == [
        "error: routes.chat.hosts: “fast” is an alias of model “qwen” on host “gpu1” and model "
        "“fast” on host “gpu2”: route “chat” would serve two models by one name."
    ]
    assert '  aliases = ["chat", "fast"]' in dump_config(hosts, routes).splitlines()
    assert parse_config(dump_config(hosts, routes))[0] == hosts


def test_an_alias_of_the_wrong_type_is_named_with_what_is_expected() -> None:
    _, _, problems = parse_config(ALIASES.replace('["chat"]', '"chat"', 1))

    assert [str(p) for p in problems] == [
        'error: hosts.gpu2.models.qwen.aliases: Expected a list of names, e.g. ["chat", "fast"].'
    ]


@pytest.mark.django_db
def test_whether_a_host_loads_models_on_demand_loads_dumps_and_is_refused_when_not_yes_or_no(
    tmp_path: Path,
) -> None:
    said = FLEET.replace("draining = true\n", 'draining = true\nloads_on_demand = "no"\n')
    crossbar_config("load", write(tmp_path, said))
    dumped = crossbar_config("dump")
    hosts, routes, _ = parse_config(said.replace('"no"', '"maybe"'))

    assert dict(Host.objects.values_list("name", "loads_on_demand")) == {"gpu1": "", "gpu2": "no"}
    assert 'loads_on_demand = "no"' in dumped
    assert dumped.count("loads_on_demand") == 1  # unknown, the default, is left out
    assert [str(p) for p in config_problems(hosts, routes)] == [
        "error: hosts.gpu2.loads_on_demand: Value 'maybe' is not a valid choice."
    ]
