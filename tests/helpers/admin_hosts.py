"""The host admin's pages and forms as an operator's browser sends them."""

from __future__ import annotations

from django.test import Client
from django.urls import reverse

from hosts.models import Host

CHANGELIST = reverse("admin:hosts_host_changelist")
ADD = reverse("admin:hosts_host_add")


def change_url(host: Host) -> str:
    return reverse("admin:hosts_host_change", args=[host.pk])


def host_form(
    models: list[dict[str, object]], initial: int = 0, **fields: object
) -> dict[str, object]:
    """The POST the host change form sends, with `models` as its inline rows."""
    data: dict[str, object] = {
        "name": "gpu1",
        "url": "http://10.0.0.5:8080",
        "weight": "1.0",
        "enabled": "on",
        "api_key": "",
        "swap_budget": "4",
        "min_residency": "60",
        "notes": "",
        "models-TOTAL_FORMS": str(len(models)),
        "models-INITIAL_FORMS": str(initial),
        "models-MIN_NUM_FORMS": "0",
        "models-MAX_NUM_FORMS": "1000",
    }
    for index, row in enumerate(models):
        row = {"upstream_name": "", "parallel": "1", "queue_max": "0", **row}
        data.update({f"models-{index}-{name}": value for name, value in row.items()})
    data.update(fields)
    return {name: value for name, value in data.items() if value is not None}


def drain(admin_client: Client, action: str, hosts: list[Host]) -> str:
    """Run a host list action on `hosts`; the messages it left."""
    response = admin_client.post(
        CHANGELIST,
        {"action": action, "_selected_action": [host.pk for host in hosts]},
        follow=True,
    )
    assert response.status_code == 200
    return "".join(str(message) for message in response.context["messages"])
