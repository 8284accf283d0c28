"""Secrets stay secret: a host's API key and a client's key never show up in the gateway's log,
in accounting rows, on admin pages or /metrics, or in any answer, whatever the request's fate."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest

from accounting.models import ClientKey
from hosts.models import Host
from tests.helpers.fleet import MODEL, add_host, add_route, chat

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/chat/v1/chat/completions"


def test_keys_never_appear_in_logs_rows_pages_or_answers(gateway, fake, ledger, admin_client):
    host_key = "sk-host-" + secrets.token_urlsafe(24)
    gpu = add_host("gpu1", fake.url, api_key=host_key, models={MODEL: (2, 2)})
    add_route("chat", [gpu])
    row = ClientKey(name="team-a")
    client_key = row.issue_key()
    row.save()
    wrong_key = client_key[:-4] + "abcd"
    gateway.sync()
    start_of_log = len(gateway.log())

    def ask(key: str | None, **body: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return ledger.client.post(URL, json=chat(**body), headers=headers)

    answers = [
        ask(client_key, stream=True, max_tokens=3),
        ask(client_key),
        ask(wrong_key),
        ask(None),
        ledger.client.post(
            URL, content=b"{not json", headers={"Authorization": f"Bearer {client_key}"}
        ),
    ]
    fake.fail_mode, fake.fail_count = "error_500", 1
    answers.append(ask(client_key))
    fake.fail_mode = "reset_before_headers"
    answers.append(ask(client_key))
    fake.fail_mode = None

    assert [answer.status_code for answer in answers] == [200, 200, 401, 401, 400, 500, 502]
    # The host got its key, and only the host.
    seen = [s for s in fake.seen if s.path == "/v1/chat/completions"]
    assert {s.headers["authorization"] for s in seen} == {f"Bearer {host_key}"}

    pages = [
        admin_client.get(path)
        for path in (
            "/admin/hosts/host/",
            f"/admin/hosts/host/{gpu.pk}/change/",
            "/admin/accounting/request/",
            "/admin/accounting/clientkey/",
            f"/admin/accounting/clientkey/{row.pk}/change/",
            "/admin/routing/route/",
        )
    ]
    assert [page.status_code for page in pages] == [200] * len(pages)
    statuses = ledger.statuses()
    assert len(statuses) == len(answers)
    texts = {
        "the gateway's log": gateway.log()[start_of_log:],
        "the rows": repr([list(r.__dict__.values()) for r in ledger.rows()]),
        "the answers": repr([(a.headers, a.content) for a in answers]),
        "the admin pages": "".join(page.content.decode() for page in pages),
        "/metrics": httpx.get(f"{gateway.url}/metrics").text,
    }
    for secret in (host_key, client_key, wrong_key, client_key[8:20], host_key[8:20]):
        for where, text in texts.items():
            assert secret not in text, f"a key shows in {where}"
    assert "team-a" in texts["the rows"]  # the client is named, by its name
    assert Host.objects.get(pk=gpu.pk).api_key == host_key  # (the check above was not vacuous)
