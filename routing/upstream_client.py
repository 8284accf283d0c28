"""The httpx client the runtime asks hosts with: its timeouts, pool and transport.

httpx's API everywhere; the transport under it is a setting (`CROSSBAR_UPSTREAM_TRANSPORT`):

- `aiohttp` (the default): the same `httpx.AsyncClient` on the `httpx-aiohttp` transport. In
  `make bench` it cut crossbar's CPU per streamed request by 29-38% and relayed 1.5x the
  chunks per second of one process (bench/README.md). Its exceptions are mapped to those
  httpcore raises for the same failure, which the proxy reads (routing/upstream_aiohttp.py),
  and it runs without keep-alive.
- `httpcore`: httpx's own transport.

tests/proxy/test_transports.py runs the key upstream faults on both; CI runs the PostgreSQL
suite on httpcore.
"""

from __future__ import annotations

import httpx

TRANSPORTS = ("httpcore", "aiohttp")


def upstream_client(transport: str, connect_timeout: float) -> httpx.AsyncClient:
    """One client for one event loop. Raises ValueError for an unknown transport, and a clear
    RuntimeError when `aiohttp` is asked for without httpx-aiohttp installed."""
    # Read timeouts are the proxy's (headers vs. idle mid-stream), so httpx's own is off. No
    # pool limit: the limiter already bounds requests per host to its slots. trust_env=False:
    # a proxy variable in the environment must not divert upstream traffic.
    timeout = httpx.Timeout(connect=connect_timeout, read=None, write=60.0, pool=None)
    if transport == "httpcore":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
    if transport == "aiohttp":
        try:
            from routing.upstream_aiohttp import aiohttp_transport
        except ModuleNotFoundError as exc:
            if exc.name not in ("aiohttp", "httpx_aiohttp"):
                raise
            raise RuntimeError(
                "CROSSBAR_UPSTREAM_TRANSPORT=aiohttp needs httpx-aiohttp: "
                ".venv/bin/pip install httpx-aiohttp"
            ) from None
        return httpx.AsyncClient(timeout=timeout, transport=aiohttp_transport(), trust_env=False)
    raise ValueError(
        f"CROSSBAR_UPSTREAM_TRANSPORT is one of {', '.join(TRANSPORTS)}, not {transport!r}"
    )
