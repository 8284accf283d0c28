"""The admin's route add form: its address and the POST it sends."""

from __future__ import annotations

from django.urls import reverse

from hosts.models import Host

ADD = reverse("admin:routing_route_add")


def route_form(hosts: list[tuple[int, Host]], **fields: object) -> dict[str, object]:
    """The POST the route add form sends, with `(position, host)` inline rows."""
    data: dict[str, object] = {
        "name": "chat",
        "default_model": "llama3",
        "lease_ttl": "1200",
        "sticky": "prefer",
        "enabled": "on",
        "queue_timeout": "300",
        "lease_patience": "2.0",
        "fallback": "",
        "fallback_after": "10.0",
        "fallback_model": "",
        "route_hosts-TOTAL_FORMS": str(len(hosts)),
        "route_hosts-INITIAL_FORMS": "0",
        "route_hosts-MIN_NUM_FORMS": "0",
        "route_hosts-MAX_NUM_FORMS": "1000",
    }
    for index, (position, host) in enumerate(hosts):
        data[f"route_hosts-{index}-position"] = str(position)
        data[f"route_hosts-{index}-host"] = str(host.pk)
    return {**data, **fields}
