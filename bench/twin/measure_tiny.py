"""The tiny model's speeds on this machine, from llama-server's own timings: the `tiny` preset.

    nice -n 10 .venv/bin/python bench/twin/measure_tiny.py [--repeats 5] [--prompt 3000]

Starts the binary of `make llama-server` on the tiny random model of tests/e2e/llama (as
`make bench-cache` does: bench/llama_hosts.py, one thread, 4,096 tokens of context per slot,
`--cache-ram 7`, `-sps 0.95`, `--slots` slots: bench-cache's 2 by default), and prints, as
medians over `--repeats`:

- prefill: `prompt_n / prompt_ms` of prompts no cache holds (`--prompt` random token ids);
- decode per stream with 1..`--slots` streams at once, each after `--context` tokens of its
  own prompt: `predicted_n / predicted_ms` of each stream;
- the start: the server started until /health answers (the model's load, as the router's);
- restore from `--cache-ram`: a prompt pushed out of its slot by one per slot, then asked
  again. llama-server times its prompt-cache update (the slot's prompt saved, the best cached
  one loaded: "prompt cache update took X ms", a trace line, hence a second server at `-lv 4`);
  a save and a load copy the same bytes per token, so the rate is (saved + loaded) / X.

Everything runs under the caller's niceness; two shared cores make single requests noisy,
which is why every figure is a median.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent.parent
sys.path[1:1] = [str(BENCH), str(BENCH.parent)]  # bench/'s modules; tests.e2e.llama's helpers

from llama_hosts import Host, Launch  # noqa: E402

from tests.e2e.llama.locate import NOT_BUILT, find_binary, vocab_path  # noqa: E402
from tests.e2e.llama.tiny_model import write_tiny_model  # noqa: E402

CACHE_RAM_MIB = 7  # bench-cache's: bench/README.md, "The fleet"
SIMILARITY = ("--slot-prompt-similarity", "0.95")
FIRST_ID, LAST_ID = 300, 31_999  # ordinary tokens of the llama vocab: no control tokens
UPDATE = re.compile(r"prompt cache update took ([0-9.]+) ms")
SAVED = re.compile(r"saving prompt with length +(\d+)")
STATE = re.compile(r"saving prompt with length +(\d+), total state size = ([0-9.]+) MiB")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(FIRST_ID, LAST_ID) for _ in range(n)]


def complete(client: httpx.Client, url: str, prompt: list[int], n_predict: int) -> dict[str, float]:
    """One /completion of token ids; its `timings` (prompt_n, prompt_ms, predicted_n, ...)."""
    body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": True}
    answer = client.post(f"{url}/completion", json=body, timeout=300)
    answer.raise_for_status()
    timings: dict[str, float] = answer.json()["timings"]
    return timings


def prefill(url: str, rng: random.Random, repeats: int, length: int) -> list[float]:
    with httpx.Client(trust_env=False) as client:
        found = [complete(client, url, tokens(rng, length), 1) for _ in range(repeats)]
    return [t["prompt_n"] / t["prompt_ms"] * 1000 for t in found]


def decode(
    url: str, rng: random.Random, repeats: int, streams: int, context: int, n: int
) -> list[float]:
    """Each stream's tokens per second while `streams` decode together after `context` tokens
    of prompt each, over every repeat."""

    def one(prompt: list[int]) -> dict[str, float]:
        with httpx.Client(trust_env=False) as client:
            return complete(client, url, prompt, n)

    rates: list[float] = []
    with ThreadPoolExecutor(streams) as pool:
        for _ in range(repeats):
            prompts = [tokens(rng, context) for _ in range(streams)]
            for t in pool.map(one, prompts):
                rates.append(t["predicted_n"] / t["predicted_ms"] * 1000)
    return rates


def restore(host: Host, log: Path, rng: random.Random, repeats: int, length: int) -> list[float]:
    """Tokens per second through --cache-ram: (saved + loaded) / the update's own time."""
    slots = host.slots
    rates: list[float] = []
    with httpx.Client(trust_env=False) as client:
        for _ in range(repeats):
            first = tokens(rng, length)
            complete(client, host.url, first, 1)
            for _ in range(slots):  # one per slot: the first's slot is taken by LRU, it is saved
                complete(client, host.url, tokens(rng, length), 1)
            seen = len(log.read_text(errors="replace"))
            again = complete(client, host.url, [*first, *tokens(rng, 1)], 1)
            written = log.read_text(errors="replace")[seen:]
            took = [float(ms) for ms in UPDATE.findall(written)]
            saved = [int(n) for n in SAVED.findall(written)]
            if took and saved and again["cache_n"] > 0 and took[-1] > 0:
                rates.append((saved[-1] + again["cache_n"]) / took[-1] * 1000)
    return rates


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=3000, help="tokens of each long prompt")
    parser.add_argument("--slots", type=int, default=2, help="bench-cache's --parallel")
    parser.add_argument(
        "--context", type=int, default=2048, help="prompt tokens before each stream decodes"
    )
    parser.add_argument("--predict", type=int, default=256, help="tokens each stream decodes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    binary, vocab = find_binary(), vocab_path()
    if binary is None or vocab is None:
        sys.exit(f"measure_tiny: {NOT_BUILT}")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="measure-tiny-") as scratch:
        work = Path(scratch)
        model = write_tiny_model(work / "tiny.gguf", vocab)
        print(f"measure_tiny: {binary}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print(f"model: {model.stat().st_size / 1e9:.4f} GB")
        host = Host("tiny", args.slots, 1, CACHE_RAM_MIB, Launch(binary, model, work, SIMILARITY))
        began = time.monotonic()
        host.start()
        print(f"started and healthy in {time.monotonic() - began:.2f} s")
        try:
            pp = prefill(host.url, rng, args.repeats, args.prompt)
            print(f"prefill tokens/s: median {median(pp):.0f} of {[round(r) for r in pp]}")
            for streams in range(1, args.slots + 1):
                tg = decode(host.url, rng, args.repeats, streams, args.context, args.predict)
                print(f"decode tokens/s per stream at {streams}: median {median(tg):.0f} "
                      f"(aggregate {streams * median(tg):.0f}) of {len(tg)} streams")  # fmt: skip
        finally:
            host.stop()
        traced = Launch(binary, model, work, (*SIMILARITY, "-lv", "4"))
        host = Host("traced", args.slots, 1, CACHE_RAM_MIB, traced)
        host.start()
        try:
            log = work / f"llama-server-{host.port}.log"
            rs = restore(host, log, rng, args.repeats, args.prompt)
            print(f"restore tokens/s: median {median(rs):.0f} of {[round(r) for r in rs]}")
            sizes = STATE.findall(log.read_text(errors="replace"))
            per_token = [float(mib) * 2**20 / int(n) for n, mib in sizes if int(n) > 0]
            print(f"--cache-ram bytes per token: median {median(per_token):.0f}")
        finally:
            host.stop()


if __name__ == "__main__":
    main()
