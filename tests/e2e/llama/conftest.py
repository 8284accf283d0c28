"""A real llama-server (built by `make llama-server`) serving a tiny random model.

Without a binary every test here skips with the reason below; CI never builds one, so it runs
these tests only on a machine whose cache already has it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.llama.locate import NOT_BUILT, find_binary, vocab_path
from tests.e2e.llama.server import LlamaServer, running_llama_server
from tests.e2e.llama.tiny_model import MissingDependency, write_tiny_model


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    """The llama-server to run: `$CROSSBAR_LLAMA_SERVER`, the cache, or PATH; else skip."""
    try:
        binary = find_binary()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    if binary is None:
        pytest.skip(NOT_BUILT)
    return binary


@pytest.fixture(scope="session")
def tiny_model(llama_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama GGUF, written once per session (its tokenizer comes from the cache)."""
    vocab = vocab_path()
    if vocab is None:
        pytest.skip(f"no vocab file cached for the tiny model; {NOT_BUILT}")
    try:
        return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf", vocab)
    except MissingDependency as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def llama(
    llama_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """llama-server with 2 slots (`-np 2`) and one thread, for completions and chat."""
    with running_llama_server(llama_binary, tiny_model, tmp_path_factory.mktemp("llama")) as srv:
        yield srv


@pytest.fixture(scope="session")
def llama_embeddings(
    llama_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """A second llama-server with `--embeddings` (mean pooling), for /v1/embeddings."""
    log_dir = tmp_path_factory.mktemp("llama-embeddings")
    extra = ("--embeddings", "--pooling", "mean")
    with running_llama_server(llama_binary, tiny_model, log_dir, extra) as srv:
        yield srv


@pytest.fixture(scope="session")
def llama_unified(
    llama_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """llama-server with 2 slots on a unified KV cache (`-kvu`, its default without `-np`):
    it saves each idle slot to its prompt cache and empties it whenever a task starts."""
    log_dir = tmp_path_factory.mktemp("llama-unified")
    with running_llama_server(llama_binary, tiny_model, log_dir, ("-kvu",)) as srv:
        yield srv


@pytest.fixture(scope="session")
def llama_similar(
    llama_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """llama-server with 2 slots and `--slot-prompt-similarity 0.95` (docs/config.md's
    advice for hosts behind crossbar): a named slot holding less than 95% of the prompt
    goes through its prompt cache, which gives back a conversation another overwrote."""
    log_dir = tmp_path_factory.mktemp("llama-similar")
    with running_llama_server(llama_binary, tiny_model, log_dir, ("-sps", "0.95")) as srv:
        yield srv


@pytest.fixture
def fresh_llama_similar(
    llama_binary: Path, tiny_model: Path, tmp_path: Path
) -> Iterator[LlamaServer]:
    """A llama-server like `llama_similar`, started for one test: its slots are empty."""
    with running_llama_server(llama_binary, tiny_model, tmp_path, ("-sps", "0.95")) as srv:
        yield srv


@pytest.fixture
def fresh_llama(llama_binary: Path, tiny_model: Path, tmp_path: Path) -> Iterator[LlamaServer]:
    """A llama-server like `llama`, started for one test: its slots are empty."""
    with running_llama_server(llama_binary, tiny_model, tmp_path) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _llama_log_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed:
        return
    for name in (
        "llama",
        "llama_embeddings",
        "llama_unified",
        "llama_similar",
    ):
        if name in request.fixturenames:
            server: LlamaServer = request.getfixturevalue(name)
            print(f"---- {name} log (tail) ----\n" + "\n".join(server.log().splitlines()[-30:]))
