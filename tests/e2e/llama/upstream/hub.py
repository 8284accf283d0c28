"""A local stand-in for Hugging Face: the tiny model under every name the upstream suite asks.

llama.cpp's tests start llama-server with `--hf-repo ... --offline`, which reads the model from
the Hugging Face cache in `$LLAMA_CACHE` (`models--<org>--<repo>/refs/main` names a snapshot,
`snapshots/<commit>/<file>` holds the files). Writing that layout with the tiny model behind
each name lets the suite's own presets, model-list assertions and router-mode model loads run
unchanged, without a network: only what the models say differs from upstream's (they are
noise), and it differs alike directly and through crossbar.
"""

from __future__ import annotations

import os
from pathlib import Path

COMMIT = "0" * 40

# repo: the files the suite's presets and tests name in it. A repo asked by tag (`:Q8_0`) needs
# a file whose name ends in that tag.
FILES: dict[str, tuple[str, ...]] = {
    "ggml-org/test-model-stories260K": ("stories260K-F32.gguf",),
    "ggml-org/test-model-stories260K-infill": ("stories260K-infill-F32.gguf",),
    "ggml-org/models": (
        "tinyllamas/stories260K.gguf",
        "bert-bge-small/ggml-model-f16.gguf",
        "jina-reranker-v1-tiny-en/ggml-model-f16.gguf",
    ),
    "ggml-org/stories15M_MOE": ("stories15M_MOE-F16.gguf",),
    "ggml-org/tinylaya-for-testing-gguf": ("tinylaya-Q8_0.gguf",),
    "ggml-org/tinygemma3-GGUF": ("tinygemma3-Q8_0.gguf",),
}


def write_hub(cache: Path, model: Path) -> Path:
    """Fill `cache` (the directory for `LLAMA_CACHE`) with links to `model`; return `cache`."""
    for repo, files in FILES.items():
        root = cache / ("models--" + repo.replace("/", "--"))
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / "main").write_text(COMMIT)
        for name in files:
            path = root / "snapshots" / COMMIT / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                os.symlink(model, path)
    return cache
