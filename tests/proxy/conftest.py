"""Fixtures for the proxy's tests."""

from __future__ import annotations

import pytest

from routing.proxy import lifecycle as lifecycle_module
from tests.helpers.relay import Ends


@pytest.fixture
def ends(monkeypatch: pytest.MonkeyPatch) -> Ends:
    recorded = Ends()
    monkeypatch.setattr(lifecycle_module, "finish", recorded)
    return recorded
