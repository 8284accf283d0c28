"""Spans typed on the command line: `m` is refused as ambiguous wherever a span is read."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from accounting.durations import parse


@pytest.mark.parametrize(
    ("text", "span"),
    [
        ("90s", timedelta(seconds=90)),
        ("15min", timedelta(minutes=15)),
        ("24h", timedelta(hours=24)),
        (" 7D ", timedelta(days=7)),
        ("3mo", timedelta(days=90)),
    ],
)
def test_the_accepted_units_are_s_min_h_d_and_mo(text: str, span: timedelta) -> None:
    assert parse(text) == span


@pytest.mark.parametrize("text", ["1m", "30M"])
def test_m_alone_is_refused_naming_min_and_mo(text: str) -> None:
    number = text[:-1]
    with pytest.raises(ValueError, match=f"write {number}min for minutes or {number}mo for months"):
        parse(text)


@pytest.mark.parametrize("text", ["1y", "10", "min", "0h", "1.5h"])
def test_anything_else_is_refused_listing_the_units(text: str) -> None:
    with pytest.raises(ValueError, match="s, min, h, d or mo"):
        parse(text)


@pytest.mark.django_db
def test_the_report_refuses_since_1m_too() -> None:
    with pytest.raises(CommandError, match="--since: “1m” is ambiguous"):
        call_command("requests_report", "--since", "1m", stdout=io.StringIO())
