"""Fixtures for the proxy's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from routing.proxy import lifecycle as lifecycle_module
from routing.runtime import Runtime, close_runtime, get_runtime
from tests.helpers.relay import Ends


@pytest.fixture
def ends(monkeypatch: pytest.MonkeyPatch) -> Ends:
    recorded = Ends()
    monkeypatch.setattr(lifecycle_module, "finish", recorded)
    return recorded


@pytest.fixture
async def runtime() -> AsyncIterator[Runtime]:
    """The process's runtime, built from the database, closed after the test."""
    rt = await get_runtime()
    yield rt
    await close_runtime()
