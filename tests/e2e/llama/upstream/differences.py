"""The documented differences: upstream tests that pass against llama-server and fail through
crossbar by design (docs/compatibility.md says why). Anything else that passes directly and
fails through crossbar is reported as UNDOCUMENTED."""

from __future__ import annotations

_ANY_ORIGIN = (
    "by design: llama-server's default CORS echoes any Origin with credentials; crossbar's `*` "
    "names `*`, never with credentials"
)
_KEY = (
    "by design: a missing or wrong key is crossbar's own 401, in OpenAI's shape "
    "(type invalid_request_error, code missing_api_key/invalid_api_key), not authentication_error"
)
_UNLISTED = (
    "by design: a route serves (and lists) the models its configuration gives the host; one a "
    "router gains or hides later is served once the host's models are read again"
)

# A test id's start (file::name, with or without its parameters) -> why it differs.
BY_DESIGN: dict[str, str] = {
    "unit/test_security.py::test_cors_options[localhost-Access-Control-Allow-Origin": _ANY_ORIGIN,
    "unit/test_security.py::test_cors_options[web.mydomain.fr-Access-Control-Allow-Origin": (
        _ANY_ORIGIN
    ),
    "unit/test_security.py::test_cors_options[origin-Access-Control-Allow-Credentials": (
        _ANY_ORIGIN
    ),
    "unit/test_security.py::test_cors_options[web.mydomain.fr-Access-Control-Allow-Headers": (
        "by design: a preflight's Allow-Headers names the headers asked for (`*` does not cover "
        "Authorization)"
    ),
    "unit/test_security.py::test_incorrect_api_key": _KEY,
    "unit/test_router.py::test_router_api_key_required": _KEY,
    "unit/test_compat_gcp.py::": (
        "by design: Vertex AI's prediction route (AIP_MODE; its path set by AIP_PREDICT_ROUTE) "
        "is the host's own deployment, not passed through"
    ),
    "unit/test_router.py::test_router_reload_models": _UNLISTED,
    "unit/test_router.py::test_router_dedup_cache_models": _UNLISTED,
    "unit/test_proxy.py::test_mcp_proxy_no_content": (
        "transport: llama-server relays the MCP server's 204 with a chunked body (`0`), which "
        "RFC 9112 forbids; aiohttp (the upstream transport) rejects the response, 502"
    ),
    "unit/test_basic.py::test_server_multiple_addresses": (
        "harness: crossbar listens on one address (crossbar_serve --bind); the test's [::1] "
        "reaches nothing"
    ),
    "unit/test_stream.py::test_stream_resumes_after_reload_during_model_load": (
        "harness: the test opens a raw socket to (host, server_port), which through crossbar "
        "is `<port>/llama`"
    ),
}


def explain(test: str) -> str | None:
    """Why `test` differs through crossbar, when that is documented; else None."""
    for start, why in BY_DESIGN.items():
        if test.startswith(start):
            return why
    return None
