"""`check` and `load` compare each host's `parallel` with the slots the host says it has."""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from hosts.models import HostModel
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import add_host
from tests.helpers.machine import free_port

pytestmark = pytest.mark.django_db

HOST = """
[[hosts]]
name = "gpu1"
url = "{url}"
{extra}
  [[hosts.models]]
  name = "llama3"
  parallel = {parallel}
"""


def write(tmp_path: Path, url: str, parallel: int | str, extra: str = "") -> str:
    path = tmp_path / "fleet.toml"
    path.write_text(HOST.format(url=url, parallel=parallel, extra=extra))
    return str(path)


def crossbar_config(*args: str) -> tuple[str, str]:
    """What the command prints: its output and its stderr."""
    err = io.StringIO()
    out = call_command("crossbar_config", *args, stdout=io.StringIO(), stderr=err)
    return out, err.getvalue()


def refusal(*args: str) -> str:
    with pytest.raises(CommandError) as refused:
        crossbar_config(*args)
    return str(refused.value)


@pytest.fixture
def fake() -> Iterator[FakeLlamaServer]:
    with FakeLlamaServer(slots=4, models=("llama3",)) as server:
        yield server


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A host that takes the connection and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


ABOVE = (
    "error: hosts.gpu1.models.llama3.parallel: parallel 6 (llama3), but the host has 4 slots "
    "(its /props total_slots): 2 of the requests the gateway lets run there would wait inside "
    "the host, where the gateway cannot see them or send them to a free host; set parallel to 4."
)
BELOW = (
    "warning: hosts.gpu1.models.llama3.parallel: parallel 3 (llama3), but the host has 4 slots "
    "(its /props total_slots): 1 of its slots stays idle; raise parallel to 4 to use them."
)


def test_check_refuses_parallel_above_the_hosts_slots(
    tmp_path: Path, fake: FakeLlamaServer
) -> None:
    text = refusal("check", write(tmp_path, fake.url, parallel=6))

    assert f"  {ABOVE}" in text.splitlines()


def test_check_warns_of_parallel_below_the_hosts_slots(
    tmp_path: Path, fake: FakeLlamaServer
) -> None:
    out, _ = crossbar_config("check", write(tmp_path, fake.url, parallel=3))

    assert out.splitlines() == [BELOW, f"{tmp_path / 'fleet.toml'}: 0 errors, 1 warning"]


def test_check_is_quiet_when_parallel_is_the_hosts_slots(
    tmp_path: Path, fake: FakeLlamaServer
) -> None:
    assert crossbar_config("check", write(tmp_path, fake.url, parallel=4)) == (
        f"{tmp_path / 'fleet.toml'}: 0 errors, 0 warnings",
        "",
    )


def test_check_of_the_database_compares_each_host_with_its_slots(fake: FakeLlamaServer) -> None:
    add_host("gpu1", fake.url, models={"llama3": (6, 8)})

    assert f"  {ABOVE}" in refusal("check").splitlines()


def test_models_of_one_host_are_judged_together_against_its_slots(
    tmp_path: Path, fake: FakeLlamaServer
) -> None:
    path = write(tmp_path, fake.url, parallel=2)
    Path(path).write_text(Path(path).read_text() + '  [[hosts.models]]\n  name = "alias"\n')

    text = refusal("check", path)

    assert "error: hosts.gpu1.models: parallel 2 (llama3) + 4 (alias) = 6, but the host" in text


def test_a_load_above_the_hosts_slots_changes_nothing_and_its_dry_run_says_so(
    tmp_path: Path, fake: FakeLlamaServer
) -> None:
    path = write(tmp_path, fake.url, parallel=6)

    assert f"  {ABOVE}" in refusal("load", "--dry-run", path).splitlines()
    assert f"  {ABOVE}" in refusal("load", path).splitlines()
    assert not HostModel.objects.exists()


def test_a_load_below_the_hosts_slots_loads_and_warns(
    tmp_path: Path, fake: FakeLlamaServer
) -> None:
    path = write(tmp_path, fake.url, parallel=3)

    assert crossbar_config("load", "--dry-run", path)[0].splitlines()[-2:] == [
        BELOW,
        "summary: 1 host added, 1 model added",
    ]
    out, _ = crossbar_config("load", path)

    assert out.splitlines() == [f"loaded {path}: 1 host added, 1 model added", BELOW]
    assert HostModel.objects.get().parallel == 3


def test_a_load_counts_the_models_the_database_keeps_for_the_host(
    tmp_path: Path, fake: FakeLlamaServer
) -> None:
    add_host("gpu1", fake.url, models={"old": (2, 8)})

    text = refusal("load", write(tmp_path, fake.url, parallel=4))

    assert "parallel 4 (llama3) + 2 (old) = 6, but the host has 4 slots" in text


def test_the_host_is_asked_with_the_key_its_variable_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU1_KEY", "sk-gpu1-0123456789")
    with FakeLlamaServer(slots=4, api_key="sk-gpu1-0123456789") as keyed:
        path = write(tmp_path, keyed.url, parallel=6, extra='api_key_env = "GPU1_KEY"')

        assert f"  {ABOVE}" in refusal("check", path).splitlines()


def test_a_host_where_nothing_listens_is_a_warning_naming_its_url(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"

    out, err = crossbar_config("check", write(tmp_path, url, parallel=6))

    *said, count = out.splitlines()
    assert count.endswith(": 0 errors, 1 warning")
    [warning] = said
    assert warning.startswith(
        f"warning: hosts.gpu1: the host did not answer: {url}/props: ConnectError: "
    )
    assert warning.endswith(
        "Requests placed on it fail until it does; its parallel was not compared with its slots."
    )
    assert err == ""


def test_a_host_that_never_answers_is_given_up_on_and_the_load_warns_of_it(
    tmp_path: Path, silent_url: str
) -> None:
    out, err = crossbar_config("load", write(tmp_path, silent_url, parallel=6))

    assert out.startswith("loaded ")
    assert f"warning: hosts.gpu1: the host did not answer: {silent_url}/props: ReadTimeout" in out


def test_a_router_mode_host_says_no_slots_so_a_note_says_it_was_not_compared(
    tmp_path: Path,
) -> None:
    with FakeLlamaServer(router_models=("llama3",)) as router:
        out, err = crossbar_config("check", write(tmp_path, router.url, parallel=6))

    assert out.endswith("0 errors, 0 warnings")
    assert err.splitlines() == [
        "note: hosts.gpu1: parallel not compared with the host's slots: a router-mode host "
        "says no slot count (each model it loads has its own)"
    ]


def test_a_parallel_of_the_wrong_type_is_one_error_not_a_second_about_the_default(
    tmp_path: Path,
) -> None:
    with FakeLlamaServer(slots=2, models=("llama3",)) as fake:
        text = refusal("check", write(tmp_path, fake.url, parallel='"2"'))

    assert text.splitlines() == [
        f"{tmp_path / 'fleet.toml'}; 1 error, 0 warnings:",
        "  error: hosts.gpu1.models.llama3.parallel: Expected an integer.",
    ]


def test_names_of_one_model_are_its_aliases_and_share_its_slots_where_models_would_be_refused(
    tmp_path: Path, fake: FakeLlamaServer
) -> None:
    path = write(tmp_path, fake.url, parallel=4, extra="")
    as_models = Path(path).read_text() + '  [[hosts.models]]\n  name = "chat"\n  parallel = 4\n'
    as_aliases = Path(path).read_text() + '  aliases = ["chat", "fast"]\n'

    Path(path).write_text(as_models)
    refused = refusal("check", path)
    Path(path).write_text(as_aliases)
    checked = crossbar_config("check", path)

    assert "parallel 4 (llama3) + 4 (chat) = 8, but the host has 4 slots" in refused
    assert checked == (f"{path}: 0 errors, 0 warnings", "")


def test_an_alias_that_is_another_models_name_is_an_error_naming_both(
    tmp_path: Path, fake: FakeLlamaServer
) -> None:
    path = write(tmp_path, fake.url, parallel=2)
    Path(path).write_text(
        Path(path).read_text()
        + '  aliases = ["chat", ""]\n'
        + '  [[hosts.models]]\n  name = "chat"\n  parallel = 2\n'
    )

    text = refusal("check", path)

    assert "error: hosts.gpu1.models.llama3.aliases: An alias may not be empty." in text
    assert (
        "error: hosts.gpu1.models.llama3.aliases: Alias “chat” of model “llama3” is model "
        "“chat”'s name on host “gpu1”." in text
    )
