"""The host admin: models inline, readable errors, drain actions, API keys never in clear."""

from __future__ import annotations

import html
from pathlib import Path

import pytest
from django.test import Client

from hosts.models import DRAINING, LOADS_ON_DEMAND, Host, HostModel
from routing.models import ConfigRevision
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.admin_hosts import ADD, CHANGELIST, change_url, drain, host_form
from tests.helpers.fleet import add_host, add_route
from tests.helpers.machine import free_port
from tests.helpers.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = pytest.mark.django_db

KEY = "sk-live-0123456789abcdef"


@pytest.fixture
def gpu1() -> Host:
    return add_host(
        "gpu1", "http://10.0.0.5:8080", models={"llama3": (4, 8), "qwen": (2, 0)}, api_key=KEY
    )


def existing_rows(host: Host) -> list[dict[str, object]]:
    return [
        {"id": m.pk, "host": host.pk, "name": m.name, "parallel": m.parallel}
        for m in host.models.all()
    ]


@pytest.mark.parametrize("url", [CHANGELIST, ADD])
def test_anonymous_users_are_sent_to_the_login_page(client: Client, url: str) -> None:
    response = client.get(url)

    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_the_list_shows_each_host_with_its_models_and_a_masked_key(
    admin_client: Client, gpu1: Host
) -> None:
    response = admin_client.get(CHANGELIST)

    page = response.content.decode()
    assert response.status_code == 200
    assert "http://10.0.0.5:8080" in page
    assert "llama3: 4/8<br>qwen: 2/0" in page  # a line each
    assert "…cdef" in page
    assert KEY not in page
    assert KEY[:-4] not in page


def test_the_add_page_renders(admin_client: Client) -> None:
    response = admin_client.get(ADD)

    assert response.status_code == 200
    assert b'name="models-TOTAL_FORMS"' in response.content


def test_the_change_page_never_echoes_the_key(admin_client: Client, gpu1: Host) -> None:
    response = admin_client.get(change_url(gpu1))

    page = response.content.decode()
    assert response.status_code == 200
    assert 'type="password" name="api_key"' in page
    assert KEY not in page
    assert "A key is set (…cdef)" in page


def test_the_host_form_asks_whether_it_loads_models_on_demand_and_says_what_it_means(
    admin_client: Client, gpu1: Host
) -> None:
    page = admin_client.get(change_url(gpu1)).content.decode()
    response = admin_client.post(
        change_url(gpu1), host_form(existing_rows(gpu1), initial=2, loads_on_demand="no")
    )

    assert "Loads models on demand" in page
    assert "Unknown: as the host says (else yes)" in page
    assert html.escape(LOADS_ON_DEMAND, quote=False) in page
    assert response.status_code == 302
    assert Host.objects.get(pk=gpu1.pk).loads_on_demand == "no"


def test_a_host_is_added_with_its_models(admin_client: Client) -> None:
    response = admin_client.post(
        ADD, host_form([{"name": "llama3", "parallel": "4", "queue_max": "8"}], api_key=KEY)
    )

    assert response.status_code == 302
    host = Host.objects.get(name="gpu1")
    assert host.api_key == KEY
    assert list(host.models.values_list("name", "parallel", "queue_max")) == [("llama3", 4, 8)]


def test_an_invalid_host_is_shown_again_with_its_errors(admin_client: Client) -> None:
    response = admin_client.post(
        ADD, host_form([{"name": "llama3", "parallel": "0"}], url="ftp://10.0.0.5", weight="0")
    )

    page = response.content.decode()
    assert response.status_code == 200
    assert "Enter a valid URL." in page
    assert "Weight must be a number greater than 0." in page
    assert "Parallel must be at least 1." in page
    assert not Host.objects.exists()
    assert not HostModel.objects.exists()


@pytest.mark.parametrize("url", ["http://10.0.0.5:8080/v1", "http://10.0.0.5:8080/v1/"])
def test_an_openai_base_url_is_refused_with_the_url_to_use_instead(
    admin_client: Client, url: str
) -> None:
    response = admin_client.post(ADD, host_form([], url=url))

    assert response.status_code == 200
    assert "Leave out the /v1" in response.content.decode()
    assert "Use http://10.0.0.5:8080." in response.content.decode()
    assert not Host.objects.exists()


def test_a_url_with_a_path_of_its_own_is_kept(admin_client: Client) -> None:
    response = admin_client.post(ADD, host_form([], url="http://proxy.lan/llama/gpu1"))

    assert response.status_code == 302
    assert Host.objects.get().url == "http://proxy.lan/llama/gpu1"


def test_a_negative_queue_is_a_form_error(admin_client: Client) -> None:
    response = admin_client.post(ADD, host_form([{"name": "llama3", "queue_max": "-1"}]))

    assert response.status_code == 200
    assert b"Ensure this value is greater than or equal to 0." in response.content
    assert not Host.objects.exists()


def test_a_model_listed_twice_is_a_form_error(admin_client: Client) -> None:
    response = admin_client.post(ADD, host_form([{"name": "llama3"}, {"name": "llama3"}]))

    assert response.status_code == 200
    assert b"Please correct the duplicate data for name" in response.content
    assert not Host.objects.exists()


def test_renaming_a_model_onto_another_is_a_form_error(admin_client: Client, gpu1: Host) -> None:
    rows = existing_rows(gpu1)
    rows[1]["name"] = "llama3"

    response = admin_client.post(change_url(gpu1), host_form(rows, initial=2))

    assert response.status_code == 200
    assert b"Please correct the duplicate data for name." in response.content
    assert set(gpu1.models.values_list("name", flat=True)) == {"llama3", "qwen"}


def test_a_host_name_taken_is_a_form_error(admin_client: Client, gpu1: Host) -> None:
    response = admin_client.post(ADD, host_form([]))

    assert response.status_code == 200
    assert b"Host with this Name already exists." in response.content
    assert Host.objects.count() == 1


def test_a_blank_key_keeps_the_current_one(admin_client: Client, gpu1: Host) -> None:
    form = host_form(existing_rows(gpu1), initial=2, notes="moved racks")

    assert admin_client.post(change_url(gpu1), form).status_code == 302

    gpu1.refresh_from_db()
    assert (gpu1.notes, gpu1.api_key) == ("moved racks", KEY)


def test_a_new_key_replaces_the_one_a_load_read_from_the_environment(
    admin_client: Client, gpu1: Host
) -> None:
    Host.objects.filter(pk=gpu1.pk).update(api_key_env="GPU1_KEY")
    form = host_form(existing_rows(gpu1), initial=2, api_key="sk-new-key-9999")

    assert admin_client.post(change_url(gpu1), form).status_code == 302

    gpu1.refresh_from_db()
    assert (gpu1.api_key, gpu1.api_key_env) == ("sk-new-key-9999", "")


def test_the_clear_box_removes_the_key(admin_client: Client, gpu1: Host) -> None:
    form = host_form(existing_rows(gpu1), initial=2, clear_api_key="on")

    assert admin_client.post(change_url(gpu1), form).status_code == 302

    gpu1.refresh_from_db()
    assert gpu1.api_key == ""


def test_a_new_key_and_the_clear_box_together_are_refused(admin_client: Client, gpu1: Host) -> None:
    form = host_form(existing_rows(gpu1), initial=2, api_key="sk-new", clear_api_key="on")

    response = admin_client.post(change_url(gpu1), form)

    assert response.status_code == 200
    assert b"Type a new API key or clear it, not both." in response.content
    gpu1.refresh_from_db()
    assert gpu1.api_key == KEY


def test_start_draining_flips_the_flag_and_counts_the_hosts(admin_client: Client) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080")
    gpu2 = add_host("gpu2", "http://10.0.0.6:8080", draining=True)
    add_host("gpu3", "http://10.0.0.7:8080")

    message = drain(admin_client, "start_draining", [gpu1, gpu2])

    assert message == f"1 host started draining (1 unchanged). {DRAINING}"
    assert dict(Host.objects.values_list("name", "draining")) == {
        "gpu1": True,
        "gpu2": True,
        "gpu3": False,
    }


def test_stop_draining_flips_the_flag_back(admin_client: Client) -> None:
    hosts = [
        add_host("gpu1", "http://10.0.0.5:8080", draining=True),
        add_host("gpu2", "http://10.0.0.6:8080", draining=True),
    ]

    message = drain(admin_client, "stop_draining", hosts)

    assert message == "2 hosts stopped draining."
    assert not Host.objects.filter(draining=True).exists()


def test_draining_from_the_list_tells_the_gateway(
    admin_client: Client, django_capture_on_commit_callbacks
) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080")
    before = ConfigRevision.current()

    with django_capture_on_commit_callbacks(execute=True):
        drain(admin_client, "start_draining", [gpu1])

    assert ConfigRevision.current() != before


def test_reading_a_host_fills_its_models_and_slots_from_the_host(admin_client: Client) -> None:
    with FakeLlamaServer(slots=3, models=("qwen-7b",)) as fake:
        gpu1 = add_host("gpu1", fake.url, models={"old-model": (4, 8)})

        message = drain(admin_client, "read_from_host", [gpu1])

    models = {m.name: (m.parallel, m.queue_max) for m in gpu1.models.all()}
    assert models == {"old-model": (4, 8), "qwen-7b": (3, 8)}
    assert "added model qwen-7b (parallel 3)" in message
    assert "old-model is configured; the host does not list it" in message


def test_reading_a_host_that_does_not_answer_says_so_and_changes_nothing(
    admin_client: Client,
) -> None:
    gpu1 = add_host("gpu1", f"http://127.0.0.1:{free_port()}")

    message = drain(admin_client, "read_from_host", [gpu1])

    assert "gpu1: cannot read it:" in message
    assert [m.name for m in gpu1.models.all()] == ["test-model"]


def test_an_operator_loads_and_unloads_a_router_mode_hosts_models(admin_client: Client) -> None:
    with FakeLlamaServer(router_models=("small", "large"), models_max=2) as router:
        gpu1 = add_host("gpu1", router.url, models={"small": (1, 0), "large": (1, 0)})

        loaded = drain(admin_client, "load_models", [gpu1])
        wait_until(lambda: router.model_status("large") == "loaded", what="the load")
        unloaded = drain(admin_client, "unload_models", [gpu1])

        assert "gpu1: load small: done" in loaded and "gpu1: load large: done" in loaded
        assert "gpu1: unload large: done" in unloaded
        assert router.model_status("large") == "unloaded"


def test_a_host_at_another_hosts_url_is_a_form_error_naming_it(admin_client: Client) -> None:
    add_host("local", "http://127.0.0.1:9001")

    response = admin_client.post(ADD, host_form([], url="http://localhost:9001/"))

    page = response.content.decode()
    assert response.status_code == 200
    assert "Host “local” has this URL too (as http://127.0.0.1:9001)" in page
    assert "Keep one host per box" in page
    assert list(Host.objects.values_list("name", flat=True)) == ["local"]


def test_hosts_that_each_say_they_share_a_url_are_saved(admin_client: Client) -> None:
    add_host("fan-a", "http://proxy.lan:8080", shares_url=True)

    response = admin_client.post(ADD, host_form([], url="http://proxy.lan:8080", shares_url="on"))

    assert response.status_code == 302
    assert Host.objects.get(name="gpu1").shares_url is True


def test_sharing_a_url_with_a_host_that_does_not_say_so_is_refused(admin_client: Client) -> None:
    add_host("local", "http://127.0.0.1:9001")

    response = admin_client.post(ADD, host_form([], url="http://127.0.0.1:9001", shares_url="on"))

    assert response.status_code == 200
    assert "(not set: “local”)" in response.content.decode()
    assert not Host.objects.filter(name="gpu1").exists()


def test_messages_name_hosts_as_they_are_written(admin_client: Client) -> None:
    gpu1 = add_host("gpu1", f"http://127.0.0.1:{free_port()}")

    response = admin_client.post(
        CHANGELIST, {"action": "read_from_host", "_selected_action": [gpu1.pk]}, follow=True
    )

    page = response.content.decode()
    assert "gpu1: cannot read it:" in page
    assert "Gpu1" not in page


def test_reading_a_host_whose_models_together_take_more_than_its_slots_is_an_error(
    admin_client: Client,
) -> None:
    with FakeLlamaServer(slots=2, models=("llama3",)) as fake:
        gpu1 = add_host("gpu1", fake.url, models={"llama3": (2, 8), "spare": (2, 8)})

        response = admin_client.post(
            CHANGELIST, {"action": "read_from_host", "_selected_action": [gpu1.pk]}, follow=True
        )

    errors = [str(m) for m in response.context["messages"] if m.level_tag == "error"]
    assert errors == [
        "gpu1: parallel 2 (llama3) + 2 (spare) = 4, but the host has 2 slots (its /props "
        "total_slots): 2 of the requests the gateway lets run there would wait inside the host, "
        "where the gateway cannot see them or send them to a free host; share its 2 among them."
    ]


def test_draining_a_routes_last_host_asks_first_and_names_the_route(admin_client: Client) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080")
    gpu2 = add_host("gpu2", "http://10.0.0.6:8080")
    off = add_host("off", "http://10.0.0.7:8080", enabled=False)
    add_route("chat", [gpu1, off])
    add_route("both", [gpu1, gpu2])

    response = admin_client.post(
        CHANGELIST, {"action": "start_draining", "_selected_action": [gpu1.pk]}
    )

    page = response.content.decode()
    assert response.status_code == 200
    assert "Route “chat”: “gpu1” is its last usable host" in page
    assert "Route “both”" not in page
    assert 'value="Yes, drain 1 host"' in page
    assert not Host.objects.get(name="gpu1").draining


def test_confirming_the_drain_drains_and_warns_again(admin_client: Client) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080")
    add_route("chat", [gpu1])

    response = admin_client.post(
        CHANGELIST,
        {"action": "start_draining", "_selected_action": [gpu1.pk], "post": "yes"},
        follow=True,
    )

    warnings = [str(m) for m in response.context["messages"] if m.level_tag == "warning"]
    assert Host.objects.get(name="gpu1").draining
    assert warnings == [
        "Route “chat”: “gpu1” is its last usable host; with it draining, new requests to the "
        "route find no host (503, or its fallback if it has one) until one of its hosts stops "
        "draining."
    ]


def test_a_drain_that_leaves_every_route_a_host_asks_nothing(admin_client: Client) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080")
    gpu2 = add_host("gpu2", "http://10.0.0.6:8080")
    add_route("chat", [gpu1, gpu2])
    add_route("off", [gpu1], enabled=False)
    add_route("idle", [add_host("gpu3", "http://10.0.0.7:8080", draining=True)])

    message = drain(admin_client, "start_draining", [gpu1])

    assert message == f"1 host started draining. {DRAINING}"


def test_draining_a_routes_last_host_from_the_list_warns_after_the_save(
    admin_client: Client,
) -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080")
    gpu2 = add_host("gpu2", "http://10.0.0.6:8080", draining=True)
    add_route("chat", [gpu1, gpu2])
    form = {
        "form-TOTAL_FORMS": "2",
        "form-INITIAL_FORMS": "2",
        "form-0-id": str(gpu1.pk),
        "form-0-draining": "on",
        "form-1-id": str(gpu2.pk),
        "form-1-draining": "on",
        "_save": "Save",
    }

    response = admin_client.post(CHANGELIST, form, follow=True)

    warnings = [str(m) for m in response.context["messages"] if m.level_tag == "warning"]
    assert Host.objects.get(name="gpu1").draining
    assert [w.split(";")[0] for w in warnings] == ["Route “chat”: “gpu1” is its last usable host"]


def test_draining_a_routes_last_host_on_its_page_warns_after_the_save(
    admin_client: Client, gpu1: Host
) -> None:
    add_route("chat", [gpu1])

    response = admin_client.post(
        change_url(gpu1), host_form(existing_rows(gpu1), initial=2, draining="on"), follow=True
    )

    warnings = [str(m) for m in response.context["messages"] if m.level_tag == "warning"]
    assert Host.objects.get(name="gpu1").draining
    assert [w.split(";")[0] for w in warnings] == ["Route “chat”: “gpu1” is its last usable host"]


def test_draining_is_said_one_way_on_the_host_form_and_in_the_docs(admin_client: Client) -> None:
    form = admin_client.get("/admin/hosts/host/add/").content.decode()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

    assert html.escape(DRAINING, quote=True) in form
    assert "takes no new requests: the conversations leased to it move to other hosts" in DRAINING
    assert [path.name for path in docs if "no new conversations" in path.read_text()] == []
    assert "takes no new requests: the conversations leased to it move" in " ".join(
        (ROOT / "README.md").read_text().split()
    )


def test_saving_a_parallel_above_the_hosts_slots_is_refused_in_the_checks_words(
    admin_client: Client,
) -> None:
    with FakeLlamaServer(slots=1, models=("llama3",)) as fake:
        response = admin_client.post(
            ADD, host_form([{"name": "llama3", "parallel": "4"}], url=fake.url)
        )

    page = response.content.decode()
    assert response.status_code == 200
    assert (
        "parallel 4 (llama3), but the host has 1 slot (its /props total_slots): 3 of the "
        "requests the gateway lets run there would wait inside the host" in page
    )
    assert "set parallel to 1." in page and "1 slots" not in page
    assert not Host.objects.exists()


def test_changing_a_hosts_parallel_below_its_slots_saves_with_a_warning(
    admin_client: Client,
) -> None:
    with FakeLlamaServer(slots=4, models=("llama3",)) as fake:
        gpu1 = add_host("gpu1", fake.url, models={"llama3": (4, 8)})
        rows = [{**row, "parallel": "3"} for row in existing_rows(gpu1)]
        response = admin_client.post(
            change_url(gpu1), host_form(rows, initial=1, url=fake.url), follow=True
        )

    warnings = [str(m) for m in response.context["messages"] if m.level_tag == "warning"]
    assert gpu1.models.get().parallel == 3
    assert warnings == [
        "gpu1: parallel 3 (llama3), but the host has 4 slots (its /props total_slots): 1 of "
        "its slots stays idle; raise parallel to 4 to use them."
    ]


def test_saving_a_host_that_does_not_answer_saves_it_and_says_parallel_was_not_compared(
    admin_client: Client,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"

    response = admin_client.post(
        ADD, host_form([{"name": "llama3", "parallel": "4"}], url=url), follow=True
    )

    warnings = [str(m) for m in response.context["messages"] if m.level_tag == "warning"]
    assert Host.objects.get(name="gpu1").models.get().parallel == 4
    assert [w.split(" (")[0] for w in warnings] == [
        "gpu1: saved, but parallel not compared with the host's slots: it did not answer"
    ]


def test_the_host_form_says_parallel_is_compared_with_the_hosts_slots_on_save(
    admin_client: Client,
) -> None:
    page = admin_client.get(ADD).content.decode()

    assert "compared with the slots the host&#x27;s /props says it has" in page
    assert "a host that does not answer is saved, with a warning" in page


def test_moving_a_host_to_an_address_with_fewer_slots_is_refused(admin_client: Client) -> None:
    with FakeLlamaServer(slots=4) as roomy, FakeLlamaServer(slots=1) as small:
        gpu1 = add_host("gpu1", roomy.url, models={"llama3": (4, 8)})
        rows = [{**row, "queue_max": "8"} for row in existing_rows(gpu1)]
        response = admin_client.post(change_url(gpu1), host_form(rows, initial=1, url=small.url))

    assert response.status_code == 200
    assert "parallel 4 (llama3), but the host has 1 slot (its /props total_slots)" in (
        response.content.decode()
    )
    assert Host.objects.get(name="gpu1").url == roomy.url


def test_a_models_aliases_are_typed_and_shown_as_names_separated_by_commas(
    admin_client: Client,
) -> None:
    row: dict[str, object] = {
        "name": "qwen",
        "parallel": "4",
        "queue_max": "8",
        "aliases": "chat,  fast",
    }
    added = admin_client.post(ADD, host_form([row]))
    host = Host.objects.get(name="gpu1")

    page = admin_client.get(change_url(host)).content.decode()
    refused = admin_client.post(
        change_url(host),
        host_form([{**existing_rows(host)[0], "aliases": "chat, qwen, chat"}], initial=1),
    )

    assert added.status_code == 302
    assert list(host.models.values_list("name", "aliases")) == [("qwen", ["chat", "fast"])]
    assert 'name="models-0-aliases" value="chat, fast"' in page
    assert refused.status_code == 200
    assert "Alias “chat” is listed twice." in refused.content.decode()


def test_reading_a_host_gives_its_model_the_other_names_it_lists_for_it(
    admin_client: Client,
) -> None:
    with FakeLlamaServer(slots=2, models=("qwen-7b",), aliases=("chat",)) as fake:
        gpu1 = add_host("gpu1", fake.url, models={"qwen-7b": (2, 8), "chat": (2, 8)})

        message = drain(admin_client, "read_from_host", [gpu1])

    assert dict(gpu1.models.values_list("name", "aliases")) == {"qwen-7b": ["chat"], "chat": []}
    assert "gpu1: qwen-7b aliases chat" in message
    assert "chat is now an alias of qwen-7b, whose slots it shares: delete the model" in message
