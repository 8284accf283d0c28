"""`make twin` (python -m twin): the table, and the same bytes every run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--workloads", "few", "--presets", "gpu-8b", "gpu-70b", "--hosts", "2", "--minutes",
         "1", "--jobs", "2"]  # fmt: skip


def twin(*args: str, hashseed: str = "random") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench"), "PYTHONHASHSEED": hashseed}
    return subprocess.run(
        [sys.executable, "-m", "twin", *args], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip


def test_the_twin_prints_the_same_table_twice_whatever_the_interpreters_hash_seed() -> None:
    first = twin(*SMALL, hashseed="1")
    again = twin(*SMALL, hashseed="2")

    assert first.returncode == 0, first.stderr
    assert first.stdout == again.stdout
    lines = first.stdout.splitlines()
    assert lines[0] == "few on 2 x gpu-8b, 1 minutes, 1 seed(s), medians"
    policies = [line.split()[0] for line in lines[2:8]]
    assert policies == ["one-host", "auto", "0", "2", "8", "30"]
    assert "few on 2 x gpu-70b" in first.stdout


def test_an_unknown_workload_or_preset_is_refused_naming_the_known_ones() -> None:
    done = twin("--workloads", "nope", "--presets", "gpu-9b")

    assert done.returncode == 2
    assert "unknown: nope, gpu-9b" in done.stderr
    assert "agent" in done.stderr and "gpu-70b" in done.stderr


def test_with_layouts_the_twin_prints_each_layouts_models_loads_and_seconds_loading() -> None:
    done = twin("--layouts", "static", "autoload", "--minutes", "2", "--jobs", "2")

    assert done.returncode == 0, done.stderr
    title, head, static, autoload = done.stdout.splitlines()[:4]
    assert title == "models_shift on 3 x gpu-mixed, 2 minutes, 1 seed(s), medians"
    assert head.split() == [
        "layout", "requests", "refused", "ttfb", "p50", "p95", "chat", "p50/p95", "code",
        "p50/p95", "reason", "p50/p95", "small", "p50/p95", "loads", "load", "s",
    ]  # fmt: skip
    assert static.split()[0] == "static" and static.split()[-2:] == ["0", "0.0"]
    assert autoload.split()[0] == "autoload" and int(autoload.split()[-2]) > 0
