"""Fixtures for the configuration's tests."""

from __future__ import annotations

import pytest

from routing.config import slots


@pytest.fixture
def hosts_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check` and `load` do not ask the hosts for their slots: for tests of the file whose
    hosts are made up (10.0.0.5), which would each be a warning that nothing answered."""
    monkeypatch.setattr(slots, "_ask", lambda host, api_keys: "not asked in this test")


@pytest.fixture
def gpu2_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """A host key in the environment, as `api_key_env = \"GPU2_KEY\"` reads it."""
    monkeypatch.setenv("GPU2_KEY", "sk-gpu2-0123456789")
    return "sk-gpu2-0123456789"
