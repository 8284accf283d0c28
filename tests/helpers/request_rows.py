"""Request rows as the recorder writes them, and the admin's list of them as a page shows it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.test import Client

from accounting.models import Request

LIST = "/admin/accounting/request/"


def add(**values: Any) -> Request:
    row: dict[str, Any] = {
        "route": "chat",
        "fingerprint": "",
        "model": "qwen",
        "host": "gpu1",
        "started": datetime(2026, 11, 30, 12, 0, tzinfo=UTC),
        "queued_ms": 0,
        "ttfb_ms": 100,
        "total_ms": 1000,
        "status": 200,
        "streamed": True,
        "lease": "new",
    }
    row.update(values)
    return Request.objects.create(**row)


def listed(client: Client, query: str = "") -> list[str]:
    """The fingerprints (first 8 characters) of the rows a changelist page shows, in order."""
    response = client.get(LIST + query)
    assert response.status_code == 200
    return [obj.fingerprint[:8] for obj in response.context["cl"].result_list]
