"""Bad input: each gets a clear 4xx in OpenAI's error shape (never a 500 or a traceback), the
host never sees it, and it leaves its row. Requests go over raw sockets where a client library
would tidy them up first (paths, methods, header bytes).

tests/proxy/test_proxy.py covers the first bad bodies and routes (malformed JSON, arrays, numbers as
models, unknown routes); these are the rest. Each test sends a whole table of cases to one
fleet, and the `ledger` checks one row per request.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.fleet import MODEL, POLLS, chat
from tests.helpers.invariants import rss_mib
from tests.helpers.wire import Answer, connect, exchange, read_one_answer

pytestmark = pytest.mark.django_db(transaction=True)

CHAT_HOST = {
    "upstream_names": {MODEL: "llama-3-8b"}
}  # the `chat_route` fixture's host (tests/conftest.py)
MiB = 1024 * 1024
LIMIT = 16 * MiB
BODY = json.dumps(chat()).encode()


@pytest.fixture
def new_log(gateway):
    """What the gateway logs from here on."""
    start = len(gateway.log())
    return lambda: gateway.log()[start:]


def completions(fake) -> list:
    return [seen for seen in fake.seen if seen.path not in POLLS]


def check_refusals(answers: dict[str, Answer], expected: dict[str, tuple]) -> None:
    """Each answer: the expected status and code (and message fragment), in OpenAI's shape."""
    for case, answer in answers.items():
        status, code, *fragment = expected[case]
        assert answer.status == status, f"{case}: {answer.status} {answer.body[:300]!r}"
        assert answer.headers["content-type"] == "application/json", case
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "code"}, case
        assert error["code"] == code, f"{case}: {error}"
        assert len(error["message"]) < 300, f"{case}: a long input is cut, not echoed"
        if fragment:
            assert fragment[0] in error["message"], f"{case}: {error}"


def statuses(answers: dict[str, Answer]) -> list[int]:
    return sorted(answer.status for answer in answers.values())


def nested(depth: int) -> bytes:
    return b'{"model": "test-model", "messages": ' + b"[" * depth + b"]" * depth + b"}"


BAD_BODIES = {
    "messages a string": (b'{"model": "test-model", "messages": "hi"}', "messages must be"),
    "messages an object": (b'{"model": "test-model", "messages": {"role": "user"}}', "messages"),
    "model a list": (b'{"model": ["test-model"], "messages": []}', "model must be a string"),
    "model an object": (b'{"model": {}, "messages": []}', "model must be a string"),
    "model null": (b'{"model": null, "messages": []}', "missing model"),
    "model 100k long": (b'{"model": "' + b"m" * 100_000 + b'"}', "longer than 200"),
    "nested 100k deep": (nested(100_000), "nested too deeply"),
    "nested 50k deep": (nested(50_000), "nested too deeply"),
    "a 5000-digit number": (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    "empty": (b"", "empty"),
}


def test_bodies_the_gateway_cannot_use_get_400(chat_route, gateway, fake, ledger, new_log):
    answers = {
        case: exchange(gateway.url, b"POST", b"/chat/v1/chat/completions", body)
        for case, (body, _) in BAD_BODIES.items()
    }
    ledger.sent(len(answers))

    expected = {case: (400, "invalid_body", fragment) for case, (_, fragment) in BAD_BODIES.items()}
    check_refusals(answers, expected)
    assert ledger.statuses() == statuses(answers)
    assert completions(fake) == []
    assert "Traceback" not in new_log()


def test_text_that_utf8_cannot_carry_reaches_a_renamed_model_escaped(
    chat_route, gateway, fake, ledger
):
    """A lone surrogate is valid JSON (as an escape) but not valid UTF-8: when the body is
    rewritten for the host's model name, it stays an escape."""
    raw = b'{"model": "test-model", "messages": [{"role": "user", "content": "half \\ud800"}]}'

    response = ledger.client.post("/chat/v1/chat/completions", content=raw)

    assert response.status_code == 200
    assert completions(fake)[-1].json["model"] == "llama-3-8b"
    assert b"\\ud800" in completions(fake)[-1].body


def test_a_body_of_exactly_16_mib_passes_and_one_byte_more_gets_413(
    chat_route, gateway, fake, ledger
):
    def body_of(size: int) -> bytes:
        head, tail = b'{"model": "test-model", "prompt": "', b'"}'
        return head + b"x" * (size - len(head) - len(tail)) + tail

    at_limit = ledger.client.post("/chat/v1/completions", content=body_of(LIMIT))
    over = exchange(gateway.url, b"POST", b"/chat/v1/completions", body_of(LIMIT + 1))
    ledger.sent()

    assert at_limit.status_code == 200
    check_refusals({"over": over}, {"over": (413, "body_too_large")})
    assert ledger.statuses() == [200, 413]
    assert len(completions(fake)) == 1


@pytest.mark.not_on(
    "daphne",
    "daphne calls the application only once a request's whole body has arrived: the 413 comes "
    "when the client has sent it all (what is past the limit is read and dropped, never kept)",
)
@pytest.mark.parametrize("framing", ["declared", "chunked"])
def test_a_body_over_the_limit_gets_413_before_the_client_has_sent_the_rest(
    chat_route, gateway, fake, ledger, framing
):
    head = [b"POST /chat/v1/completions HTTP/1.1", b"Host: localhost"]
    sent = b'{"model": "test-model", "prompt": "' + b"x" * (LIMIT + MiB)
    if framing == "declared":  # a length over the limit: nothing of it need be read
        head.append(b"Content-Length: %d" % (4 * LIMIT))
    else:  # no length: read until past the limit
        head.append(b"Transfer-Encoding: chunked")
        sent = b"%x\r\n%s\r\n" % (len(sent), sent)
    sock = connect(gateway.url, timeout=60)
    ledger.sent()
    sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + sent)  # and never the rest

    try:
        answer = read_one_answer(sock)
    except TimeoutError:
        pytest.fail("no answer within 60 s: the gateway waits for the rest of the body")
    finally:
        sock.close()

    check_refusals({framing: answer}, {framing: (413, "body_too_large")})
    assert ledger.statuses() == [413]
    assert completions(fake) == []


def test_a_chunked_body_without_a_length_is_read_and_bounded(chat_route, gateway, fake, ledger):
    def chunks(total: int):
        yield b'{"model": "test-model", "prompt": "'
        for _ in range(total // MiB):
            yield b"x" * MiB
        yield b'"}'

    small = ledger.client.post("/chat/v1/chat/completions", content=iter([BODY[:10], BODY[10:]]))
    before = rss_mib(gateway.process.pid)
    huge = ledger.client.post("/chat/v1/completions", content=chunks(200 * MiB), timeout=60)
    grown = rss_mib(gateway.process.pid) - before

    assert small.status_code == 200
    assert completions(fake)[0].json["messages"] == chat()["messages"]
    assert huge.status_code == 413
    assert huge.json()["error"]["code"] == "body_too_large"
    # The server keeps at most 16 MiB + 1 byte of a body, whatever the client sends (daphne
    # alone would hold all 200 MiB, more than once).
    assert grown < 100
    assert len(completions(fake)) == 1


PATH_TRICKS = {
    b"/chat/../admin/": (404, "not_found"),
    b"/chat/v1/../../admin/": (404, "not_found"),
    b"//chat/v1/chat/completions": (400, "missing_route"),
    b"//admin/": (400, "missing_route"),
    b"/chat%2Fv1%2Fchat%2Fcompletions": (404, "not_found", "encoded slash"),
    b"/chat/v1/chat%2F..%2F..%2Fadmin/": (404, "not_found"),
    b"/%2e%2e/admin/": (404, "unknown_route"),
    b"/ch%40t/v1/chat/completions": (404, "unknown_route"),
    b"/ch%00t/v1/chat/completions": (404, "unknown_route"),
    b"/" + b"r" * 5000 + b"/v1/chat/completions": (404, "unknown_route"),
    b"/chat/v1/chat/completions%3Fx=1": (404, "not_found"),
}


def test_path_tricks_get_a_clear_error_and_never_reach_the_admin_or_the_host(
    chat_route, gateway, fake, ledger, new_log
):
    answers = {
        target.decode(): exchange(gateway.url, b"POST", target, BODY) for target in PATH_TRICKS
    }
    # A path naming no route, nor any endpoint, is no request for the gateway: answered, but
    # not in the books (an API path with a wrong route is a client's, and has its row).
    proxied = {t: a for t, a in answers.items() if t != "/%2e%2e/admin/"}
    ledger.sent(len(proxied))

    check_refusals(answers, {t.decode(): e for t, e in PATH_TRICKS.items()})
    assert ledger.statuses() == statuses(proxied)
    assert completions(fake) == []
    assert "Traceback" not in new_log()


@pytest.mark.parametrize(
    "method",
    [
        b"PUT",
        b"PROPFIND",
        pytest.param(
            b"BREW",
            marks=pytest.mark.not_on(
                "uvicorn",
                "its HTTP parser (httptools) answers a method it does not know 400 itself, "
                "before any application sees the request (no row)",
            ),
        ),
    ],
)
def test_a_method_llama_server_does_not_serve_gets_405_with_the_allowed_ones(
    chat_route, gateway, fake, ledger, method
):
    answer = exchange(gateway.url, method, b"/chat/v1/chat/completions", b"\xff")
    ledger.sent()

    check_refusals({"answer": answer}, {"answer": (405, "method_not_allowed")})
    assert ledger.statuses() == [405]
    assert answer.headers["allow"] == "GET, HEAD, POST, DELETE, OPTIONS"
    assert completions(fake) == []


ODD_ROUTES = [b"\xe9t\xe9", b"chat/../admin", b"c" * 8000, b"chat, code", b"../chat"]


def test_an_odd_route_header_is_an_unknown_route(chat_route, gateway, fake, ledger):
    answers = {
        repr(route[:20]): exchange(
            gateway.url,
            b"POST",
            b"/v1/chat/completions",
            BODY,
            headers={b"X-Crossbar-Route": route},
        )
        for route in ODD_ROUTES
    }
    ledger.sent(len(answers))

    check_refusals(answers, dict.fromkeys(answers, (404, "unknown_route")))
    assert ledger.statuses() == [404] * len(ODD_ROUTES)
    assert completions(fake) == []


def test_bytes_that_are_not_http_are_refused_by_the_server_and_it_keeps_serving(
    chat_route, gateway, fake, ledger
):
    """Raw non-ASCII bytes in a request line are not HTTP: the HTTP server answers a bare 400
    before the gateway sees a request, so there is no row (and nothing reaches a host)."""
    for target in (b"/\xc3\xa9t\xc3\xa9/v1/chat/completions", b"/chat/v1/models?\xff"):
        answer = exchange(gateway.url, b"POST", target, BODY)
        assert answer.status == 400

    assert ledger.client.get("/chat/v1/models").status_code == 200
    assert completions(fake) == []
