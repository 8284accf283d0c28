"""The httpx client the runtime asks hosts with: its timeouts, pool and transport.

httpx's API everywhere; the transport under it is a setting (`CROSSBAR_UPSTREAM_TRANSPORT`):

- `httpcore` (the default): httpx's own.
- `aiohttp`: the same `httpx.AsyncClient` on the `httpx-aiohttp` transport. In `make bench` it
  cut crossbar's CPU per streamed request by 27-38% and nearly doubled what one process relays
  (bench/README.md, "The levers"). It runs without keep-alive: aiohttp hands a pooled
  connection to the next request without checking whether the host closed it, and
  llama-server closes every connection after a stream while saying keep-alive.
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
            import aiohttp
            from httpx_aiohttp import AiohttpTransport
        except ImportError:
            raise RuntimeError(
                "CROSSBAR_UPSTREAM_TRANSPORT=aiohttp needs httpx-aiohttp: "
                ".venv/bin/pip install httpx-aiohttp"
            ) from None

        def session() -> aiohttp.ClientSession:
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            return aiohttp.ClientSession(connector=connector)

        on_aiohttp = AiohttpTransport(client=session)
        return httpx.AsyncClient(timeout=timeout, transport=on_aiohttp, trust_env=False)
    raise ValueError(
        f"CROSSBAR_UPSTREAM_TRANSPORT is one of {', '.join(TRANSPORTS)}, not {transport!r}"
    )
