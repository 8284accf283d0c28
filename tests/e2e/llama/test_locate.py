"""Which llama-server the real-binary tests run: the named one, the cached one, or PATH's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.llama.locate import binary_expected, find_binary


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def places(tmp_path, monkeypatch):
    """An empty cache and an empty PATH, so the machine's own llama-server stays out of it."""
    monkeypatch.delenv("CROSSBAR_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("CROSSBAR_LLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    return tmp_path


def test_nothing_found_means_the_tests_skip(places):
    assert find_binary() is None and not binary_expected()


def test_the_cache_comes_before_path(places):
    executable(places / "path" / "llama-server")
    cached = executable(places / "cache" / "bin" / "llama-server")

    assert find_binary() == cached


def test_path_is_used_when_nothing_is_cached(places):
    on_path = executable(places / "path" / "llama-server")

    assert find_binary() == on_path and binary_expected()


def test_a_named_binary_comes_first(places, monkeypatch):
    executable(places / "cache" / "bin" / "llama-server")
    named = executable(places / "elsewhere" / "llama-server")
    monkeypatch.setenv("CROSSBAR_LLAMA_SERVER", str(named))

    assert find_binary() == named


def test_a_named_binary_that_is_missing_is_an_error_not_a_skip(places, monkeypatch):
    monkeypatch.setenv("CROSSBAR_LLAMA_SERVER", str(places / "nope"))

    with pytest.raises(FileNotFoundError, match="is not an executable file"):
        find_binary()
    assert binary_expected()  # so the fixture runs and reports the error
