"""Stand-in for `filelock`, which llama.cpp's conftest imports to serialise model downloads
across parallel workers: the suite runs here in one process, with no downloads."""

from __future__ import annotations

import contextlib


class FileLock(contextlib.nullcontext[None]):
    def __init__(self, path: str) -> None:
        super().__init__()
