"""A bad value in the environment stops the gateway with one line naming the variable, not a
traceback, and a value outside its range is refused as well."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.machine import ROOT


def check_with(**settings: str) -> subprocess.CompletedProcess[str]:
    """`manage.py check` with `settings` in its environment, as `make run` starts."""
    env = {**os.environ, **settings}
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("CROSSBAR_SLOT_PROMPT_SIMILARITY", "high", "'high' is not valid: it is not a number"),
        ("CROSSBAR_SLOT_PROMPT_SIMILARITY", "1.5", "1.5 is not valid: it is a share, from 0 to 1"),
        ("CROSSBAR_PREFIX_MARGIN", "one", "'one' is not valid: it is not a whole number"),
        ("CROSSBAR_REDIS_HOLD_TTL", "five", "'five' is not valid: it is not a number"),
    ],
)
def test_a_bad_setting_stops_the_gateway_with_one_line_that_names_it(name, value, said):
    result = check_with(**{name: value})

    assert result.returncode == 1
    assert result.stderr.strip() == f"crossbar: {name}={said}"
    assert "Traceback" not in result.stderr + result.stdout


def test_a_similarity_within_its_range_passes():
    result = check_with(CROSSBAR_SLOT_PROMPT_SIMILARITY="0.95")

    assert result.returncode == 0, result.stderr
