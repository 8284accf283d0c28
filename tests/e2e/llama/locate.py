"""Where `make llama-server` (build.sh) put the llama-server binary and its vocab files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DEFAULT_CACHE = Path("/var/cache/crossbar/llama-server")
VOCAB = "ggml-vocab-llama-spm.gguf"
NOT_BUILT = "llama-server not built: run `make llama-server` (about 15 minutes)"


def cache_dir() -> Path:
    """The cache build.sh fills: `$CROSSBAR_LLAMA_CACHE`, else /var/cache/crossbar/llama-server."""
    return Path(os.environ.get("CROSSBAR_LLAMA_CACHE") or DEFAULT_CACHE)


def find_binary() -> Path | None:
    """`$CROSSBAR_LLAMA_SERVER`, then the cache's bin/llama-server, then `llama-server` on PATH.

    A `CROSSBAR_LLAMA_SERVER` that is set but not an executable file is an error rather than a
    silent fall-through: whoever set it meant that binary.
    """
    explicit = os.environ.get("CROSSBAR_LLAMA_SERVER")
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"CROSSBAR_LLAMA_SERVER={explicit} is not an executable file")
        return path
    cached = cache_dir() / "bin" / "llama-server"
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def vocab_path() -> Path | None:
    """The vocab-only GGUF the tiny model takes its tokenizer from, or None when not cached."""
    path = cache_dir() / "models" / VOCAB
    return path if path.is_file() else None


def binary_expected() -> bool:
    """True when a binary is found or named: tests then run (and a wrong name fails loudly)."""
    return bool(os.environ.get("CROSSBAR_LLAMA_SERVER")) or find_binary() is not None
