"""The endpoint table: each endpoint's class and who may reach it, and the docs that show it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from routing.core.endpoints import ENDPOINTS, Endpoint, Kind, Opener, endpoint_of

ROOT = Path(__file__).resolve().parent.parent.parent
METHODS = ("GET", "HEAD", "POST")


def served(method: str, path: str) -> Endpoint:
    endpoint = endpoint_of(method, path)
    assert endpoint is not None, f"{method} {path} is not served"
    return endpoint


def classes(kind: Kind) -> set[tuple[str, str]]:
    """Every (method, path) of the class (HEAD is GET's)."""
    return {
        (method, path)
        for path in ENDPOINTS
        for method in ("GET", "POST")
        if served(method, path).kind is kind
    }


def test_host_state_is_only_health_reading_props_and_a_routers_model_events() -> None:
    assert classes(Kind.HOST_STATE) == {
        ("GET", "/health"),
        ("POST", "/health"),
        ("GET", "/v1/health"),
        ("POST", "/v1/health"),
        ("GET", "/props"),
        ("GET", "/models/sse"),
        ("POST", "/models/sse"),
    }


def test_every_control_that_shows_or_changes_a_host_is_a_host_control() -> None:
    assert classes(Kind.HOST_CONTROL) == {
        (method, path)
        for path in (
            "/slots", "/slots/<id>", "/metrics", "/lora-adapters", "/models/load",
            "/models/unload", "/cors-proxy", "/v1/stream", "/v1/streams/lookup",
        )
        for method in ("GET", "POST")
    } | {("POST", "/props"), ("POST", "/models")}  # fmt: skip


def test_a_router_downloading_or_deleting_a_model_is_model_management() -> None:
    for method in ("POST", "DELETE"):
        endpoint = served(method, "/models")
        assert endpoint.kind is Kind.HOST_CONTROL, method
        assert endpoint.opened_by is Opener.MODEL_MANAGEMENT, method
    assert served("GET", "/models").kind is Kind.MODELS


def test_model_management_opens_with_manage_models_and_the_rest_with_host_controls() -> None:
    openers = {
        (method, path): served(method, path).opened_by
        for method, path in classes(Kind.HOST_CONTROL)
    }

    for (method, path), opener in openers.items():
        expected = Opener.MODEL_MANAGEMENT if path.startswith("/models") else Opener.HOST_CONTROLS
        assert opener is expected, (method, path)
    assert Opener.HOST_CONTROLS.value == "open_host_controls"
    assert Opener.MODEL_MANAGEMENT.value == "manage_models"


def test_only_host_controls_are_an_operators_and_each_says_why() -> None:
    for path, entry in ENDPOINTS.items():
        for endpoint in entry:
            assert endpoint.operators_only == (endpoint.kind is Kind.HOST_CONTROL), path
            assert bool(endpoint.why) == endpoint.operators_only, path
    assert "fetch any URL" in served("GET", "/cors-proxy").why


def test_head_is_answered_as_get() -> None:
    for path in ENDPOINTS:
        assert endpoint_of("HEAD", path) is endpoint_of("GET", path), path


def test_one_named_host_serves_its_state_and_controls_but_not_model_loading() -> None:
    about = {path for path in ENDPOINTS if served("GET", path).about_the_host}

    assert about == {
        "/health", "/v1/health", "/props", "/slots", "/slots/<id>", "/metrics", "/lora-adapters",
        "/cors-proxy",
        "/v1/stream", "/v1/streams/lookup", "/models/sse",
    }  # fmt: skip


def test_only_the_health_check_is_anyones() -> None:
    assert {(m, p) for p in ENDPOINTS for m in ("GET", "POST") if served(m, p).keyless} == {
        (method, path) for method in ("GET", "POST") for path in ("/health", "/v1/health")
    }


def test_a_resumable_stream_is_a_host_control_since_its_id_is_all_it_asks() -> None:
    for method, path in (("GET", "/v1/stream"), ("DELETE", "/v1/stream"),
                         ("POST", "/v1/streams/lookup")):  # fmt: skip
        assert served(method, path).opened_by is Opener.HOST_CONTROLS, (method, path)
    assert "another user's too" in served("GET", "/v1/stream").why


def test_saving_restoring_or_erasing_one_slot_changes_the_host() -> None:
    for slot in ("/slots/0", "/slots/17"):
        assert served("POST", slot) is served("POST", "/slots/<id>"), slot
    assert served("POST", "/slots/0").opened_by is Opener.HOST_CONTROLS
    assert "changes the host's state" in served("POST", "/slots/0").why


def test_the_body_names_the_model_where_the_gateway_must_read_it() -> None:
    reads = {path for path in ENDPOINTS if served("POST", path).names_model}

    assert reads == {
        path for path in ENDPOINTS if served("POST", path).kind in (Kind.GENERATE, Kind.INSPECT)
    } | {"/models/load", "/models/unload"}


@pytest.mark.parametrize(
    "path",
    ["/v2/chat", "/v1/completion", "/hosts/gpu1/slots", "//v1/models", "/v1/../slots", "/slots/",
     "/slots/x", "/slots/0/", "/slots/-1", "", "slots", "/", "/admin"],
)  # fmt: skip
def test_paths_llama_server_does_not_serve_have_no_endpoint(path: str) -> None:
    assert all(endpoint_of(method, path) is None for method in METHODS)


def documented_table() -> dict[str, list[str]]:
    """docs/architecture.md's endpoint table, "One request" step 1: class -> its endpoints."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    step = text[text.index("1. **Route.**") : text.index("2. **Client.**")]
    rows = [line.strip() for line in step.splitlines() if line.strip().startswith("|")]
    table: dict[str, list[str]] = {}
    for row in rows[2:]:  # past the head and its rule
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        table[cells[0]] = re.findall(r"`([^`]+)`", cells[1])
    return table


def expand(written: str) -> set[tuple[str, str]]:
    """`GET /props` -> {(GET, /props)}; `(/v1)/models` -> both paths; no method: GET and POST."""
    method, _, path = written.rpartition(" ")
    methods = (method,) if method else ("GET", "POST")
    paths = [path.replace("(/v1)", "/v1"), path.replace("(/v1)", "")]
    return {(m, p) for m in methods for p in dict.fromkeys(paths)}


def test_the_architecture_docs_table_is_the_codes() -> None:
    documented = {
        (method, path): kind
        for kind, endpoints in documented_table().items()
        for written in endpoints
        for method, path in expand(written)
    }

    assert set(documented.values()) == {kind.value for kind in Kind}
    assert documented == {
        (method, path): served(method, path).kind.value
        for path in ENDPOINTS
        for method in ("GET", "POST")
    }
