"""Two hosts at one URL are one box counted twice: refused wherever hosts enter, unless marked."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from hosts.address import address
from hosts.models import Host
from tests.helpers.fleet import add_host

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("hosts_not_asked")]

TWO_AT_ONE_URL = """
[[hosts]]
name = "local"
url = "http://127.0.0.1:{port}"
{local_shares}
  [[hosts.models]]
  name = "llama3"

[[hosts]]
name = "again"
url = "http://LOCALHOST:{port}/"
{again_shares}
  [[hosts.models]]
  name = "llama3"
"""


def crossbar_config(*args: str) -> str:
    return call_command("crossbar_config", *args, stdout=io.StringIO(), stderr=io.StringIO())


def fleet(tmp_path: Path, local: bool = False, again: bool = False, port: int = 1) -> str:
    """Two hosts at one address (port 1: nothing answers there, so no slots are compared)."""
    path = tmp_path / "fleet.toml"
    path.write_text(
        TWO_AT_ONE_URL.format(
            port=port,
            local_shares="shares_url = true" if local else "",
            again_shares="shares_url = true" if again else "",
        )
    )
    return str(path)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("http://GPU1.lan:8080", "http://gpu1.lan:8080/"),
        ("http://gpu1.lan", "http://gpu1.lan:80"),
        ("https://gpu1.lan/", "HTTPS://gpu1.lan:443"),
        ("http://localhost:9001", "http://127.0.0.1:9001"),
        ("http://[::1]:9001", "http://localhost:9001/"),
        ("http://proxy.lan/llama/gpu1/", "http://proxy.lan:80/llama/gpu1"),
    ],
)
def test_urls_that_differ_only_in_how_they_are_written_are_one_address(
    one: str, other: str
) -> None:
    assert address(one) == address(other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("http://gpu1.lan:8080", "http://gpu1.lan:8081"),
        ("http://gpu1.lan", "https://gpu1.lan"),
        ("http://proxy.lan/llama/gpu1", "http://proxy.lan/llama/gpu2"),
        ("http://127.0.0.1:9001", "http://10.0.0.5:9001"),
    ],
)
def test_urls_that_lead_elsewhere_are_other_addresses(one: str, other: str) -> None:
    assert address(one) != address(other)


def test_check_refuses_two_hosts_at_one_url_naming_the_other_and_what_to_do(
    tmp_path: Path,
) -> None:
    with pytest.raises(CommandError) as refused:
        crossbar_config("check", fleet(tmp_path))

    text = str(refused.value)
    assert "2 errors, 0 warnings" in text
    assert (
        "error: hosts.local.url: Host “again” has this URL too (as http://LOCALHOST:1): two "
        "hosts for one box let it run the sum of their parallel at once, more than its slots. "
        "Keep one host per box; or, if this URL really leads to several boxes (a proxy that fans "
        "out), set shares_url (“Shares URL” in the admin) on each host with it (not set: "
        "“local”, “again”)."
    ) in text
    assert "error: hosts.again.url: Host “local” has this URL too (as http://127.0.0.1:1)" in text


def test_check_accepts_hosts_at_one_url_when_each_of_them_says_it_shares_it(
    tmp_path: Path,
) -> None:
    assert crossbar_config("check", fleet(tmp_path, local=True, again=True)).endswith(
        "0 errors, 0 warnings"
    )


def test_marking_only_one_of_the_hosts_is_not_enough(tmp_path: Path) -> None:
    with pytest.raises(CommandError) as refused:
        crossbar_config("check", fleet(tmp_path, again=True))

    assert "1 error, 0 warnings" in str(refused.value)
    assert "error: hosts.local.url: Host “again” has this URL too" in str(refused.value)
    assert "(not set: “local”)" in str(refused.value)


def test_check_of_the_database_refuses_two_hosts_at_one_url() -> None:
    add_host("local", "http://127.0.0.1:1")
    add_host("again", "http://localhost:1")

    with pytest.raises(CommandError, match=r"hosts\.local\.url: Host “again” has this URL too"):
        crossbar_config("check")


def test_a_load_adding_a_host_at_a_url_the_database_has_changes_nothing(tmp_path: Path) -> None:
    add_host("local", "http://127.0.0.1:1")
    path = tmp_path / "more.toml"
    path.write_text('[[hosts]]\nname = "127-0-0-1-1"\nurl = "http://127.0.0.1:1"\n')

    for args in (["load", "--dry-run"], ["load"]):
        with pytest.raises(CommandError) as refused:
            crossbar_config(*args, str(path))
        assert "hosts.127-0-0-1-1.url: Host “local” has this URL too" in str(refused.value)

    assert list(Host.objects.values_list("name", flat=True)) == ["local"]


def test_a_load_of_hosts_that_share_their_url_on_purpose_stores_it(tmp_path: Path) -> None:
    assert "2 hosts added" in crossbar_config("load", fleet(tmp_path, local=True, again=True))

    assert set(Host.objects.values_list("name", "shares_url")) == {
        ("local", True),
        ("again", True),
    }
