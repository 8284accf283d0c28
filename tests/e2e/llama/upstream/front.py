"""crossbar in front of each llama-server the upstream suite starts.

One gateway (`manage.py crossbar_serve`, as `tests.helpers.gateway.running_gateway` runs it)
serves the whole upstream session, on its own SQLite database. Each time a test starts a
llama-server, the fleet is rewritten to that one server, configured as an operator who wants
llama-server's own behaviour would: one host (its `--api-key` as the host's key), a model per
id its `/v1/models` lists, and one route `llama` whose clients may do what llama-server's may
(`open_host_controls`, `manage_models`; a single-model server's route maps any model name to
its model, `map_unknown_models`, as the server ignores the name), with llama-server's CORS rule
where crossbar has it (`cors_origins`). A test
that starts llama-server with `--api-key K` talks to crossbar with the same key: crossbar is
given a client key K, so a missing or wrong key meets crossbar's own check.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from tests.helpers.machine import ROOT

ROUTE = "llama"
QUEUE_MAX = 64  # the suite fires a few requests at once at a server; llama-server queues them
# Gateway settings for llama-server's pace on a shared CPU (running_gateway's are for fakes):
# a router may load a model before the first byte, and a slow slot may pause a stream.
GATEWAY_SETTINGS = {
    "CROSSBAR_HEADERS_TIMEOUT": "600",
    "CROSSBAR_STREAM_IDLE_TIMEOUT": "120",
    "CROSSBAR_HEALTH_INTERVAL": "1",
    "CROSSBAR_HEALTH_TIMEOUT": "2",
    "CROSSBAR_LOG_LEVEL": "WARNING",
    "PYTHONPATH": str(ROOT),  # not the stand-ins for llama.cpp's test dependencies
}


def setup_django(work: Path) -> None:
    """Point Django at a fresh database in `work` and create its tables."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "crossbar_site.settings"
    os.environ["DATABASE_URL"] = f"sqlite:///{work / 'crossbar.sqlite3'}"
    os.environ["CROSSBAR_VAR_DIR"] = str(work / "var")
    os.environ.pop("CROSSBAR_REDIS_URL", None)
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0, interactive=False)


class Front:
    """The gateway, and the fleet it serves for the llama-server running now."""

    def __init__(self, work: Path) -> None:
        setup_django(work)
        from tests.helpers.gateway import running_gateway

        log_dir = work / "gateway"
        log_dir.mkdir(exist_ok=True)
        self._stack = contextlib.ExitStack()
        self.gateway = self._stack.enter_context(running_gateway(log_dir, **GATEWAY_SETTINGS))
        self.port = int(self.gateway.url.rsplit(":", 1)[1])
        self._starts = 0

    def close(self) -> None:
        self._stack.close()

    def serve(self, server: Any, host_url: str) -> None:
        """Make route `llama` serve the llama-server `server` (upstream's ServerProcess) at
        `host_url`, and wait until the gateway has loaded it."""
        from django.db import transaction

        from accounting.keys import hash_key, shown_prefix
        from accounting.models import ClientKey
        from hosts.describe import Unreachable, read_host
        from hosts.models import Host
        from routing.models import Route
        from tests.helpers.fleet import add_host, add_route

        api_key = server.api_key or ""
        try:
            described = read_host(host_url, api_key)
            models, router = list(described.models), described.router
            parallel = described.slots or server.n_slots or 1
        except Unreachable:  # a router with nothing to list: the route serves no model
            models, router, parallel = [], True, server.n_slots or 1
        self._starts += 1
        with transaction.atomic():
            ClientKey.objects.all().delete()
            Route.objects.all().delete()
            Host.objects.all().delete()
            # A fresh name per start: a new server is a new host, with no health from the last.
            host = add_host(
                f"llama-{self._starts}",
                host_url,
                models={model: (parallel, QUEUE_MAX) for model in models},
                api_key=api_key,
            )
            add_route(
                ROUTE,
                [host],
                default_model=models[0] if models else "",
                # A single-model llama-server answers whatever model a request names.
                map_unknown_models=not router,
                open_host_controls=True,
                manage_models=True,
                cors_origins=cors_origins(server),
            )
            if api_key:
                ClientKey.objects.create(
                    name="suite", prefix=shown_prefix(api_key), key_hash=hash_key(api_key)
                )
        self.gateway.sync(timeout=30)


def cors_origins(server: Any) -> str:
    """llama-server's `--cors-origins` as a route's `cors_origins`.

    llama-server's default `*` (any origin, with credentials) is crossbar's `*` (any origin,
    never with credentials); its `localhost` (also its default once tools or MCP are on) is
    crossbar's default rule, an empty list; a list of origins is the same list.
    """
    origins = server.cors_origins
    if origins is None:
        tools = server.server_tools or server.mcp_servers_config or server.mcp_servers_json
        origins = "localhost" if tools else "*"
    return "" if origins == "localhost" else origins
