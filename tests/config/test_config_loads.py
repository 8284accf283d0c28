"""Config that does not fight the admin: a file is loaded when it changed, and says what it did."""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from hosts.models import Host, HostModel
from routing.models import ConfigFileLoad, Route

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("hosts_not_asked", "gpu2_key")]

FLEET = """
[[hosts]]
name = "gpu1"
url = "http://10.0.0.5:8080"
  [[hosts.models]]
  name = "llama3"
  parallel = 4
  queue_max = 8

[[hosts]]
name = "gpu2"
url = "http://10.0.0.6:8080"
api_key_env = "GPU2_KEY"
  [[hosts.models]]
  name = "llama3"
  parallel = 2
  queue_max = 4
  [[hosts.models]]
  name = "qwen"
  parallel = 2
  queue_max = 0

[[routes]]
name = "chat"
default_model = "llama3"
hosts = ["gpu1", "gpu2"]
"""

WHEN = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"


@pytest.fixture
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding crossbar.toml, as the working directory of `make run`."""
    (tmp_path / "crossbar.toml").write_text(FLEET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CROSSBAR_CONFIG", "crossbar.toml")
    return tmp_path


def setup() -> list[str]:
    """What `make run` prints after the admin line, as lines."""
    return call_command("crossbar_setup", stdout=io.StringIO()).splitlines()[1:]


def crossbar_config(*args: str) -> str:
    return call_command("crossbar_config", *args, stdout=io.StringIO())


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def fleet_rows() -> tuple[list[tuple], ...]:
    return (
        list(Host.objects.values_list()),
        list(HostModel.objects.values_list()),
        list(Route.objects.values_list("name", "default_model", "route_hosts__host__name")),
        list(ConfigFileLoad.objects.values_list()),
    )


def test_the_first_start_loads_the_file_and_records_what_it_loaded(config_dir: Path) -> None:
    assert setup() == ["loaded crossbar.toml: 2 hosts added, 3 models added, 1 route added"]

    [load] = ConfigFileLoad.objects.all()
    assert load.path == str(config_dir / "crossbar.toml")
    assert load.sha256 == hashlib.sha256(FLEET.encode()).hexdigest()
    assert load.summary == "2 hosts added, 3 models added, 1 route added"


def test_a_restart_with_an_unchanged_file_keeps_the_admins_edits(config_dir: Path) -> None:
    setup()
    Host.objects.filter(name="gpu1").update(url="http://10.0.0.99:8080", draining=True)
    HostModel.objects.filter(host__name="gpu1").update(parallel=2)

    [line] = setup()

    assert re.fullmatch(rf"crossbar.toml unchanged since {WHEN}: not loaded", line)
    gpu1 = Host.objects.get(name="gpu1")
    assert (gpu1.url, gpu1.draining, gpu1.models.get().parallel) == (
        "http://10.0.0.99:8080",
        True,
        2,
    )
    assert ConfigFileLoad.objects.count() == 1


def test_a_changed_file_is_loaded_and_says_what_changed_but_a_drained_host_stays_drained(
    config_dir: Path,
) -> None:
    setup()
    Host.objects.filter(name="gpu2").update(draining=True)
    path = config_dir / "crossbar.toml"
    edit(path, "parallel = 2\n  queue_max = 4", "parallel = 3\n  queue_max = 4")
    edit(path, "parallel = 2\n  queue_max = 0", "parallel = 1\n  queue_max = 0")
    path.write_text(path.read_text() + '\n[[hosts]]\nname = "gpu3"\nurl = "http://10.0.0.7:8080"\n')

    lines = setup()

    assert lines == [
        "loaded crossbar.toml: 1 host added, 2 models changed",
        "note: host gpu2 stays draining (the file says draining = false; a load leaves "
        "draining as the admin set it)",
    ]
    assert Host.objects.get(name="gpu2").draining is True
    assert HostModel.objects.get(host__name="gpu2", name="llama3").parallel == 3
    assert [load.summary for load in ConfigFileLoad.objects.all()] == [
        "1 host added, 2 models changed",
        "2 hosts added, 3 models added, 1 route added",
    ]


def test_no_load_ever_undrains_or_drains_an_existing_host(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.replace('name = "gpu2"', 'name = "gpu2"\ndraining = true'))
    crossbar_config("load", str(path))
    assert Host.objects.get(name="gpu2").draining is True  # a new host takes the file's value
    Host.objects.filter(name="gpu2").update(draining=False)
    Host.objects.filter(name="gpu1").update(draining=True)

    crossbar_config("load", str(path))

    assert dict(Host.objects.values_list("name", "draining")) == {"gpu1": True, "gpu2": False}


def test_a_dry_run_prints_what_would_be_added_changed_and_removed_and_writes_nothing(
    tmp_path: Path, gpu2_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    crossbar_config("load", str(path))
    Host.objects.create(name="spare", url="http://10.0.0.9:8080")
    monkeypatch.setenv("GPU2_KEY", "sk-gpu2-new-key-987")
    edit(path, 'url = "http://10.0.0.5:8080"', 'url = "http://10.0.0.50:8080"\nweight = 2.5')
    edit(path, "parallel = 2\n  queue_max = 0", "parallel = 1\n  queue_max = 0")
    edit(path, '[[routes]]\nname = "chat"', '[[routes]]\nname = "chat"\nlease_ttl = 600')
    edit(path, 'hosts = ["gpu1", "gpu2"]', 'hosts = ["gpu1"]')
    before = fleet_rows()

    output = crossbar_config("load", "--dry-run", str(path))

    assert output.splitlines() == [
        f"{path}: dry run, nothing written. A load would:",
        '  change host gpu1: url "http://10.0.0.5:8080" -> "http://10.0.0.50:8080"; '
        "weight 1.0 -> 2.5",
        "  change host gpu2: api key replaced",
        "  change model gpu2/qwen: parallel 2 -> 1",
        "  change route chat: lease_ttl 1200 -> 600; hosts [gpu1, gpu2] -> [gpu1]",
        "  keep what the file does not name (--prune removes it): host spare",
        "summary: 2 hosts changed, 1 model changed, 1 route changed",
    ]
    assert "sk-gpu2" not in output
    assert fleet_rows() == before


def test_a_dry_run_with_prune_lists_the_removals(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    crossbar_config("load", str(path))
    spare = Host.objects.create(name="spare", url="http://10.0.0.9:8080")
    HostModel.objects.create(host=spare, name="tiny")
    Route.objects.create(name="batch")
    edit(path, '  [[hosts.models]]\n  name = "qwen"\n  parallel = 2\n  queue_max = 0\n', "")
    before = fleet_rows()

    output = crossbar_config("load", "--dry-run", "--prune", str(path))

    assert output.splitlines() == [
        f"{path}: dry run, nothing written. A load would:",
        "  remove model gpu2/qwen",
        "  remove route batch",
        "  remove host spare",
        "  remove model spare/tiny",
        "summary: 1 host removed, 2 models removed, 1 route removed",
    ]
    assert fleet_rows() == before


def test_a_load_does_what_its_dry_run_said_and_then_there_is_nothing_left_to_do(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    crossbar_config("load", str(path))
    Route.objects.create(name="batch")
    edit(path, "parallel = 4", "parallel = 6")
    path.write_text(
        path.read_text() + '\n[[routes]]\nname = "cpu"\nhosts = ["gpu2"]\ndefault_model = "qwen"\n'
    )
    edit(path, 'default_model = "llama3"', 'default_model = "llama3"\nfallback = "cpu"')

    planned = crossbar_config("load", "--dry-run", "--prune", str(path)).splitlines()[-1]
    done = crossbar_config("load", "--prune", str(path))
    again = crossbar_config("load", "--dry-run", "--prune", str(path))

    changed = "1 model changed, 1 route added, 1 route changed, 1 route removed"
    assert planned == f"summary: {changed}"
    assert done == f"loaded {path}: {changed}"
    assert again.splitlines()[1:] == ["  change nothing", "summary: nothing changed"]
    assert Route.objects.get(name="chat").fallback == Route.objects.get(name="cpu")


def test_a_dry_run_of_a_bad_file_lists_its_errors_like_a_load(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.replace('default_model = "llama3"', 'default_model = "mistral"'))

    with pytest.raises(Exception, match="nothing was changed; 1 error") as refused:
        crossbar_config("load", "--dry-run", str(path))

    assert "routes.chat.default_model" in str(refused.value)
    assert not Host.objects.exists() and not ConfigFileLoad.objects.exists()


def test_the_admin_lists_the_loads_newest_first_and_read_only(config_dir: Path) -> None:
    setup()
    edit(config_dir / "crossbar.toml", "parallel = 4", "parallel = 5")
    setup()
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "", "pw"))
    url = "/admin/routing/configfileload/"

    page = client.get(url).content.decode()

    assert page.index("1 model changed") < page.index("2 hosts added, 3 models added")
    assert str(config_dir / "crossbar.toml") in page
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", page)
    newest = ConfigFileLoad.objects.first()
    assert newest is not None
    assert client.get(url + "add/").status_code == 403
    assert client.post(f"{url}{newest.pk}/change/", {"summary": "x"}).status_code == 403
    assert client.post(f"{url}{newest.pk}/delete/", {"post": "yes"}).status_code == 403
    assert ConfigFileLoad.objects.count() == 2


def test_a_load_says_and_writes_the_aliases_it_adds_to_a_model(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    crossbar_config("load", str(path))
    edit(path, '  name = "qwen"\n', '  name = "qwen"\n  aliases = ["chat", "fast"]\n')

    dry = crossbar_config("load", "--dry-run", str(path))
    crossbar_config("load", str(path))

    assert '  change model gpu2/qwen: aliases [] -> ["chat", "fast"]' in dry.splitlines()
    assert HostModel.objects.get(host__name="gpu2", name="qwen").aliases == ["chat", "fast"]
