"""What the running gateway knows of each host right now, for the admin.

The gateway's runtime lives in `routing`, which `hosts` must not import; the runtime registers
a provider here instead (`provide`), and the host admin asks `host_states()`. In a process with
no gateway serving (a `manage.py` shell, the test client), there is nothing to show.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HostStates = dict[str, dict[str, Any]]

_provider: Callable[[], HostStates] | None = None


def provide(provider: Callable[[], HostStates]) -> None:
    """Register where live host states come from (called once, at app start)."""
    global _provider
    _provider = provider


def host_states() -> HostStates:
    """{host name: state} as `routing.ops.dashboard.state` describes it; {} without a gateway."""
    if _provider is None:
        return {}
    try:
        return _provider()
    except Exception:  # the admin page must render even if the gateway is busy or stopping
        return {}
