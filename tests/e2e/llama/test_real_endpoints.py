"""Every endpoint family of a real llama-server through a route (native completion, Responses,
Anthropic messages, the tokenizer, the host's own state), not the fake: status and shape as the
client sees them, and the row the gateway writes. Skips without a llama-server binary."""

from __future__ import annotations

from contextlib import closing

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from accounting.models import Request
from tests.e2e.llama.locate import NOT_BUILT, binary_expected
from tests.e2e.llama.server import ALIAS
from tests.helpers.fleet import add_host, add_route
from tests.helpers.gateway import signed_in
from tests.helpers.waits import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not binary_expected(), reason=NOT_BUILT),
]

HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def base(gateway, llama) -> str:
    add_route("tiny", [add_host("llama1", llama.url, models={ALIAS: (2, 4)})], default_model=ALIAS)
    gateway.sync()
    return f"{gateway.url}/tiny"


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/completion", {"prompt": "Once upon a time", "n_predict": 4}, "content"),
        ("/v1/responses", {"input": "Say hello.", "max_output_tokens": 4}, "output"),
        ("/v1/messages", {"max_tokens": 4, "messages": HI}, "content"),
    ],
)
def test_a_real_host_generates_through_every_api_shape_and_the_row_counts_it(base, path, body, key):
    started = timezone.now()

    response = httpx.post(f"{base}{path}", json=body, timeout=60)

    assert response.status_code == 200, response.text
    assert key in response.json()
    assert response.headers["x-crossbar-placement"] == "new"
    row = wait_until(
        lambda: Request.objects.filter(started__gte=started).first(), what="the row", timeout=20
    )
    assert (row.status, row.host, row.model) == (200, "llama1", ALIAS)
    assert row.prompt_tokens and row.completion_tokens


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/tokenize", {"content": "hello world"}, "tokens"),
        ("/detokenize", {"tokens": [1, 2, 3]}, "content"),
        ("/apply-template", {"messages": HI}, "prompt"),
        ("/v1/messages/count_tokens", {"messages": HI}, "input_tokens"),
    ],
)
def test_a_real_hosts_tokenizer_answers_through_the_route(base, path, body, key):
    response = httpx.post(f"{base}{path}", json=body, timeout=30)

    assert response.status_code == 200, response.text
    assert key in response.json()
    assert response.headers["x-crossbar-placement"] == "none"


@pytest.mark.parametrize("path", ["/slots", "/props", "/hosts/llama1/slots", "/hosts/llama1/props"])
def test_a_real_hosts_own_state_is_reachable_by_an_operator(base, gateway, path):
    get_user_model().objects.create_user("admin", password="password", is_staff=True)

    with closing(signed_in(gateway)) as operator:  # host controls are the operator's
        response = operator.get(f"{base}{path}", timeout=30)

    assert response.status_code == 200, response.text
    assert response.headers["x-crossbar-host"] == "llama1"


def test_a_browser_preflight_follows_the_routes_rule_not_the_real_hosts(base, llama):
    asked = {"Origin": "http://app.test", "Access-Control-Request-Method": "POST"}

    gateway_answer = httpx.options(f"{base}/v1/chat/completions", headers=asked)
    host_answer = httpx.options(f"{llama.url}/v1/chat/completions", headers=asked)

    assert gateway_answer.status_code == host_answer.status_code == 200
    # A llama-server without tools names any origin; the route lists none, so only pages on
    # localhost are named (tests/proxy/test_cors.py), and http://app.test is not one.
    assert "access-control-allow-origin" not in gateway_answer.headers
    assert "access-control-allow-credentials" not in gateway_answer.headers
