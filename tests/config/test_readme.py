"""The README's first steps run as written: its fake, its crossbar.toml, its Python example.

Only the ports change (a test may not take 9001 and 8080 on a shared machine); every other
byte is the README's.
"""

from __future__ import annotations

import io
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.core.management import call_command

from tests.helpers.machine import free_port
from tests.helpers.waits import wait_until_healthy

ROOT = Path(__file__).resolve().parent.parent.parent
README = (ROOT / "README.md").read_text()
FAKE = ".venv/bin/python -m tests.fakes.llama_server"

pytestmark = pytest.mark.django_db(transaction=True)


def fake_command() -> list[str]:
    [line] = [line for line in README.splitlines() if line.startswith(FAKE)]
    return shlex.split(line.removeprefix(FAKE))


def block(language: str, containing: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README, re.S)
    [found] = [text for text in blocks if containing in text]
    return found


@pytest.fixture
def readme_fake() -> Iterator[int]:
    """The README's fake llama-server, started with its arguments on a free port."""
    args = fake_command()
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.llama_server", *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )

    try:
        wait_until_healthy(
            process,
            f"http://127.0.0.1:{port}",
            lambda: f"the README's fake exited with {process.returncode}",
            "the README's fake to listen",
        )
        yield port
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_the_readmes_python_example_streams_an_answer_from_the_readmes_fake(
    readme_fake: int, gateway, tmp_path: Path
) -> None:
    config = block("toml", "127.0.0.1:9001").replace("127.0.0.1:9001", f"127.0.0.1:{readme_fake}")
    (tmp_path / "crossbar.toml").write_text(config)
    call_command("crossbar_config", "load", str(tmp_path / "crossbar.toml"), stdout=io.StringIO())
    gateway.sync()
    example = block("python", "from openai import OpenAI")
    asked = re.search(r'model="([^"]+)"', example)
    served = httpx.get(f"http://127.0.0.1:{readme_fake}/v1/models").json()["data"]

    run = subprocess.run(
        [sys.executable, "-c", example.replace("http://127.0.0.1:8080", gateway.url)],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert asked is not None and asked[1] in [model["id"] for model in served]
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip(), "the example printed no answer"
