"""Client keys: who may use the gateway, which routes, how much; the key never leaks."""

from __future__ import annotations

import hashlib
import re
import threading
from datetime import UTC, datetime

import httpx
import pytest
from django.core.management import call_command

from accounting.keys import hash_key
from accounting.models import ClientKey, Request
from routing.core.clients import ClientGate, ClientSpec, bearer_token
from routing.core.errors import ClientLimited, InvalidKey, MissingKey, RouteNotAllowed, answer_for
from tests.helpers.asking import issue, post
from tests.helpers.fleet import add_host, add_route, chat
from tests.helpers.gateway import running_gateway
from tests.helpers.waits import wait_until

# -- the gate, without a database ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def presented(authorization: str | None) -> str | None:
    """What the proxy hands the gate for an `Authorization` header: the key's sha256."""
    token = bearer_token(authorization)
    return hash_key(token) if token else None


def gate_with(*specs: tuple[str, ClientSpec], require: bool = False) -> tuple[ClientGate, Clock]:
    clock = Clock()
    gate = ClientGate(require=require, clock=clock)
    gate.configure({hash_key(key): spec for key, spec in specs})
    return gate, clock


def test_without_keys_requests_pass_anonymously() -> None:
    gate, _ = gate_with()

    assert not gate.required
    assert gate.identify(presented(None)) is None
    assert gate.identify(presented("Bearer whatever")) is None


def test_require_key_refuses_every_request_until_a_key_exists() -> None:
    gate, _ = gate_with(require=True)

    with pytest.raises(MissingKey):
        gate.identify(presented(None))
    with pytest.raises(InvalidKey):
        gate.identify(presented("Bearer cb-anything"))


def test_a_known_key_identifies_its_client_and_others_are_refused() -> None:
    team = ClientSpec("team-a")
    gate, _ = gate_with(("cb-secret", team))

    assert gate.identify(presented("Bearer cb-secret")) is team
    assert gate.identify(presented("bearer   cb-secret ")) is team
    for header in (None, "", "Basic cb-secret", "Bearer"):
        with pytest.raises(MissingKey):
            gate.identify(presented(header))
    with pytest.raises(InvalidKey) as refused:
        gate.identify(presented("Bearer cb-secreT"))
    assert "cb-secre" not in refused.value.message


def test_a_key_with_routes_may_use_only_those() -> None:
    gate, _ = gate_with(("k", ClientSpec("team-a", routes=frozenset({"chat", "code"}))))
    client = gate.identify(presented("Bearer k"))
    assert client is not None

    gate.admit(client, "chat").release()
    with pytest.raises(RouteNotAllowed):
        gate.admit(client, "embed")


def test_concurrency_is_limited_until_a_pass_is_released_once() -> None:
    gate, _ = gate_with(("k", ClientSpec("team-a", max_concurrent=2)))
    client = gate.identify(presented("Bearer k"))
    assert client is not None

    first, _second = gate.admit(client, "chat"), gate.admit(client, "chat")
    with pytest.raises(ClientLimited) as limited:
        gate.admit(client, "chat")
    first.release()
    first.release()  # idempotent: frees one place, not two
    third = gate.admit(client, "chat")

    assert limited.value.retry_after == 1
    assert gate.in_flight("team-a") == 2
    with pytest.raises(ClientLimited):
        gate.admit(client, "chat")
    third.release()
    assert gate.in_flight("team-a") == 1


def test_requests_per_minute_slide_and_say_when_to_retry() -> None:
    gate, clock = gate_with(("k", ClientSpec("team-a", per_minute=3)))
    client = gate.identify(presented("Bearer k"))
    assert client is not None

    for step in range(3):
        gate.admit(client, "chat").release()
        clock.now += 10 if step < 2 else 0
    with pytest.raises(ClientLimited) as limited:
        gate.admit(client, "chat")
    clock.now += 40.5  # the first admission (at +0) leaves the window just after +60
    gate.admit(client, "chat").release()
    with pytest.raises(ClientLimited):
        gate.admit(client, "chat")

    assert limited.value.retry_after == 40  # 60 s after the first, which was 20 s ago
    assert answer_for(limited.value).status == 429


def test_reconfiguring_keeps_the_counts_of_keys_that_remain() -> None:
    gate, _ = gate_with(("k", ClientSpec("team-a", max_concurrent=1)))
    client = gate.identify(presented("Bearer k"))
    assert client is not None
    held = gate.admit(client, "chat")

    gate.configure({hash_key("k"): ClientSpec("team-a", max_concurrent=1), hash_key("j"): client})

    with pytest.raises(ClientLimited):
        gate.admit(client, "chat")
    held.release()
    gate.admit(client, "chat")


def test_bearer_token_reads_only_the_bearer_scheme() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("BEARER abc") == "abc"
    assert bearer_token("Token abc") == ""
    assert bearer_token(None) == ""


# -- the gateway ------------------------------------------------------------------------------


def rows_for(n: int, since: datetime) -> list[Request]:
    """The rows of requests started after `since`, oldest first, once `n` are written.

    `since` keeps out the late rows of the test before, which the shared gateway may write
    after the database was emptied.
    """
    rows = Request.objects.filter(started__gte=since).order_by("started")
    wait_until(lambda: rows.count() >= n, what=f"{n} request rows")
    return list(rows)


@pytest.mark.django_db(transaction=True)
def test_with_a_key_configured_requests_need_it(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    key = issue("team-a")
    gateway.sync()
    start = datetime.now(UTC)

    missing = post(gateway)
    wrong = post(gateway, key=key[:-1] + ("x" if key[-1] != "x" else "y"))
    right = post(gateway, key=key)

    assert missing.status_code == wrong.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert wrong.json()["error"] == {
        "message": "invalid API key",
        "type": "invalid_request_error",
        "code": "invalid_api_key",
    }
    assert right.status_code == 200
    rows = rows_for(3, start)
    assert [(r.status, r.client) for r in rows] == [(401, ""), (401, ""), (200, "team-a")]


@pytest.mark.django_db(transaction=True)
def test_a_disabled_key_is_refused_and_a_deleted_one_too(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    key = issue("team-a")
    other = issue("team-b")
    kept = issue("team-c")  # keys stay required: an enabled key remains
    gateway.sync()
    assert post(gateway, key=key).status_code == 200

    ClientKey.objects.get(name="team-a").delete()
    row = ClientKey.objects.get(name="team-b")
    row.enabled = False
    row.save()
    gateway.sync()

    assert post(gateway, key=key).status_code == 401
    assert post(gateway, key=other).status_code == 401
    assert post(gateway, key=kept).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_a_key_may_use_only_its_routes(gateway, fake):
    gpu1 = add_host("gpu1", fake.url)
    add_route("chat", [gpu1])
    add_route("code", [gpu1])
    key = issue("team-a", routes="chat")
    gateway.sync()
    start = datetime.now(UTC)

    allowed = post(gateway, "chat", key=key)
    refused = post(gateway, "code", key=key)

    assert allowed.status_code == 200
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "route_not_allowed"
    assert "“code”" in refused.json()["error"]["message"]
    assert [(r.status, r.client) for r in rows_for(2, start)] == [(200, "team-a"), (403, "team-a")]


@pytest.mark.django_db(transaction=True)
def test_over_max_concurrent_a_key_gets_429_until_its_request_ends(gateway, fake):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url)])
    key = issue("team-a", max_concurrent=1)
    gateway.sync()

    holder = threading.Thread(
        target=post, args=(gateway,), kwargs={"key": key, "stream": True, "max_tokens": 15}
    )
    holder.start()
    wait_until(lambda: fake.in_flight == 1, what="the first request to run")
    limited = post(gateway, key=key)
    holder.join()
    after = post(gateway, key=key)

    assert limited.status_code == 429
    assert limited.reason_phrase == "Too Many Requests"  # not Twisted's "Unknown Status"
    assert limited.headers["retry-after"] == "1"
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert after.status_code == 200


@pytest.mark.django_db(transaction=True)
def test_every_way_a_request_ends_gives_its_concurrency_back(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    key = issue("team-a", max_concurrent=1)
    gateway.sync()

    answers = [
        post(gateway, key=key),
        post(gateway, key=key, model="not-served"),  # 404 after admission
        httpx.get(f"{gateway.url}/chat/v1/models", headers={"Authorization": f"Bearer {key}"}),
    ]
    fake.fail_mode = "error_500"
    answers.append(post(gateway, key=key))
    fake.fail_mode, fake.token_delay = None, 0.05
    with httpx.stream(  # the client leaves mid-stream
        "POST",
        f"{gateway.url}/chat/v1/chat/completions",
        json=chat(stream=True, max_tokens=50),
        headers={"Authorization": f"Bearer {key}"},
    ) as response:
        next(response.iter_raw())
    # The gateway notices the departure on its own time; then the place is free again.
    wait_until(lambda: post(gateway, key=key).status_code == 200, what="the place back")

    assert [a.status_code for a in answers] == [200, 404, 200, 500]
    wait_until(
        lambda: Request.objects.filter(status=499, client="team-a").exists(), what="the 499 row"
    )


@pytest.mark.django_db(transaction=True)
def test_over_requests_per_minute_a_key_gets_429_with_retry_after(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    key = issue("team-a", requests_per_minute=2)
    other = issue("team-b")
    gateway.sync()

    answers = [post(gateway, key=key) for _ in range(3)]
    unaffected = post(gateway, key=other)

    assert [a.status_code for a in answers] == [200, 200, 429]
    assert 1 <= int(answers[2].headers["retry-after"]) <= 60
    assert "2 requests per minute" in answers[2].json()["error"]["message"]
    assert unaffected.status_code == 200


@pytest.mark.django_db(transaction=True)
def test_the_key_is_never_stored_logged_or_sent_upstream(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    key = issue("team-a")
    gateway.sync()

    start = datetime.now(UTC)
    post(gateway, key=key, stream=True, max_tokens=2)
    post(gateway, key=key + "-wrong")
    rows = rows_for(2, start)

    stored = ClientKey.objects.get(name="team-a")
    assert stored.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert key.startswith(stored.prefix) and len(stored.prefix) < 10
    for row in rows:
        assert all(key not in str(value) for value in row.__dict__.values())
    assert key not in gateway.log()
    upstream = [s for s in fake.seen if s.path == "/v1/chat/completions"]
    assert upstream and all(key not in str(s.headers) for s in upstream)
    assert all("authorization" not in s.headers for s in upstream)


@pytest.mark.django_db(transaction=True)
def test_the_report_groups_requests_by_client(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    a, b = issue("team-a"), issue("team-b")
    gateway.sync()
    start = datetime.now(UTC)
    for key in (a, a, b):
        post(gateway, key=key)
    rows_for(3, start)
    Request.objects.filter(started__lt=start).delete()

    report = call_command("requests_report", "--by", "client", "--format", "csv")

    lines = report.splitlines()
    assert lines[0].startswith("client,requests,")
    assert {tuple(line.split(",")[:2]) for line in lines[1:]} == {("team-a", "2"), ("team-b", "1")}


@pytest.fixture
def gateway_requiring_keys(django_db_setup, tmp_path):
    with running_gateway(tmp_path, CROSSBAR_REQUIRE_KEY="true") as gw:
        yield gw


@pytest.mark.django_db(transaction=True)
def test_require_key_refuses_requests_before_any_key_exists(gateway_requiring_keys, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway_requiring_keys.sync()

    response = post(gateway_requiring_keys)

    assert response.status_code == 401
    assert httpx.get(f"{gateway_requiring_keys.url}/health").status_code == 200


# -- the admin --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_admin_shows_a_new_key_once_and_stores_its_hash(admin_client):
    add_route("chat", [])
    add_route("code", [])
    response = admin_client.post(
        "/admin/accounting/clientkey/add/",
        {
            "name": "team-a",
            "enabled": "on",
            "routes": ["chat", "code"],
            "max_concurrent": "4",
            # Past the "turns authentication on" page (tests/accounting/test_client_keys_admin.py).
            "_confirm_authentication": "yes",
        },
        follow=True,
    )

    shown = re.search(r"cb-[A-Za-z0-9_-]{43}", response.content.decode())
    assert shown is not None
    key = shown.group(0)
    row = ClientKey.objects.get(name="team-a")
    assert row.key_hash == hash_key(key)
    assert row.route_names == ["chat", "code"] and row.max_concurrent == 4
    again = admin_client.get(f"/admin/accounting/clientkey/{row.pk}/change/").content.decode()
    listed = admin_client.get("/admin/accounting/clientkey/").content.decode()
    assert key not in again and key not in listed
    assert f"{row.prefix}…" in listed


@pytest.mark.django_db
def test_replacing_a_key_shows_the_new_one_and_the_old_stops_matching(admin_client):
    old = issue("team-a")
    row = ClientKey.objects.get(name="team-a")

    response = admin_client.post(
        "/admin/accounting/clientkey/",
        # "post": past the confirmation page (tests/accounting/test_client_keys_admin.py).
        {"action": "replace_keys", "_selected_action": [row.pk], "post": "yes"},
        follow=True,
    )

    new = re.search(r"cb-[A-Za-z0-9_-]{43}", response.content.decode())
    row.refresh_from_db()
    assert new is not None and new.group(0) != old
    assert row.key_hash == hash_key(new.group(0)) != hash_key(old)
