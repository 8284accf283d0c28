"""The httpx client the runtime asks hosts with: its timeouts, pool and transport.

httpx's API everywhere, on the `httpx-aiohttp` transport (aiohttp's I/O): in `make bench` it
cut crossbar's CPU per streamed request by 29-38% against httpx's own httpcore transport and
relayed 1.5x the chunks per second of one process (bench/README.md), so it is the one transport
(two would be two sets of failure behaviours to keep true). Its exceptions are mapped to those
httpcore raises for the same failure, which the proxy reads (routing/upstream_aiohttp.py), and
it runs without keep-alive.
"""

from __future__ import annotations

import httpx

from routing.upstream_aiohttp import aiohttp_transport


def upstream_client(connect_timeout: float) -> httpx.AsyncClient:
    """One client for one event loop."""
    # Read timeouts are the proxy's (headers vs. idle mid-stream), so httpx's own is off. No
    # pool limit: the limiter already bounds requests per host to its slots. trust_env=False:
    # a proxy variable in the environment must not divert upstream traffic.
    timeout = httpx.Timeout(connect=connect_timeout, read=None, write=60.0, pool=None)
    return httpx.AsyncClient(timeout=timeout, transport=aiohttp_transport(), trust_env=False)
