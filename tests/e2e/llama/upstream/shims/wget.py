"""Stand-in for `wget`, which llama.cpp's utils.py imports to download test files: there is no
network here, so a test that downloads fails, alike directly and through crossbar."""

from __future__ import annotations


def download(url: str, out: str | None = None) -> str:
    raise OSError(f"no network in this run: cannot download {url}")
