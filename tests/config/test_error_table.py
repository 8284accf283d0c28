"""The README's table of error codes is the one the code writes, and names every code the
gateway can answer or record."""

from __future__ import annotations

import ast
import io
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

import routing.proxy.view  # noqa: F401  (imports every error the gateway answers)
from routing.core.error_table import END, START, error_classes, rows, with_table

ROOT = Path(__file__).resolve().parent.parent.parent
README = ROOT / "README.md"
CODE_LIKE = re.compile(r"[a-z]+(_[a-z]+)+")


def sources() -> Iterator[ast.Module]:
    for package in ("routing", "crossbar_site", "hosts", "accounting"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" not in path.parts:
                yield ast.parse(path.read_text(), str(path))


def parameters(trees: list[ast.Module]) -> dict[str, list[int]]:
    """For each function (or dataclass) name, the positions of its parameter named `code`, as
    a call passes them (a method's `self` is not passed)."""
    found: dict[str, list[int]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [arg.arg for arg in node.args.posonlyargs + node.args.args]
                names = names[1:] if names[:1] in (["self"], ["cls"]) else names
            elif isinstance(node, ast.ClassDef):
                names = [
                    item.target.id
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                ]
            else:
                continue
            if "code" in names:
                found.setdefault(node.name, []).append(names.index("code"))
    return found


def callee(call: ast.Call) -> str:
    function = call.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")


def strings(nodes: list[ast.expr]) -> Iterator[str]:
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def codes_in_the_source() -> set[str]:
    """Every code-like string the source puts where a code goes: assigned to `code`, passed
    as a parameter named `code` (by keyword or position), under a `"code"` key, or in a tuple
    that starts with an HTTP status (an outcome kept for later)."""
    trees = list(sources())
    positions = parameters(trees)
    found: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(getattr(target, "id", "") == "code" for target in targets):
                    found.update(strings([node.value]))
            elif isinstance(node, ast.Call):
                found.update(strings([kw.value for kw in node.keywords if kw.arg == "code"]))
                for index in positions.get(callee(node), []):
                    found.update(strings(node.args[index : index + 1]))
            elif isinstance(node, ast.Dict):
                keys = list(strings([key for key in node.keys if key is not None]))
                pairs = zip(node.keys, node.values, strict=True)
                found.update(strings([v for k, v in pairs if k is not None and "code" in keys
                                      and getattr(k, "value", None) == "code"]))  # fmt: skip
            elif isinstance(node, ast.Tuple) and node.elts:
                first = node.elts[0]
                if isinstance(first, ast.Constant) and first.value in range(100, 600):
                    found.update(strings(node.elts[1:]))
    return {code for code in found if CODE_LIKE.fullmatch(code)}


def table_codes() -> set[str]:
    text = README.read_text()
    table = text[text.index(START) : text.index(END)]
    return set(re.findall(r"^\| [^|]+ \| `([a-z_]+)` \|", table, re.M))


def test_the_readmes_table_of_error_codes_is_the_one_the_code_writes() -> None:
    text = README.read_text()

    assert with_table(text) == text, "run: .venv/bin/python manage.py crossbar_error_table"


def test_every_code_the_gateway_answers_or_records_is_in_the_readmes_table() -> None:
    in_source = codes_in_the_source()

    assert {"queue_full", "upstream_failed", "client_disconnected", "upstream_error"} <= in_source
    assert in_source - table_codes() == set()


def test_every_error_class_has_a_row_saying_when_a_client_meets_its_code() -> None:
    listed = {row.code: row for row in rows()}

    for cls in error_classes():
        assert cls.code in listed, cls
        if "code" in vars(cls):
            assert "when" in vars(cls) and cls.when, f"{cls.__name__} says not when"
    assert {"bad_request", "invalid_host", "internal_error", "operator_only"} <= set(listed)
    assert "model_management_not_allowed" in table_codes()


def test_a_stale_table_is_rewritten_and_the_check_names_the_command() -> None:
    stale = f"# title\n\n{START}\n| status | code | when |\n{END}\n\nafter\n"

    written = with_table(stale)

    assert written.startswith(f"# title\n\n{START}\n| status | code | when |\n|---|")
    assert "| 503 | `queue_full` |" in written and written.endswith(f"{END}\n\nafter\n")
    with pytest.raises(ValueError, match="markers"):
        with_table("no markers here")


def test_the_command_says_the_readmes_table_is_current() -> None:
    out = io.StringIO()

    call_command("crossbar_error_table", "--check", stdout=out)

    assert "is current" in out.getvalue()


def test_the_command_check_fails_on_a_table_that_differs(monkeypatch, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"{START}\n| old |\n{END}\n")
    monkeypatch.setattr("routing.management.commands.crossbar_error_table.readme", lambda: readme)

    with pytest.raises(CommandError, match="not current"):
        call_command("crossbar_error_table", "--check", stdout=io.StringIO())
    call_command("crossbar_error_table", stdout=io.StringIO())

    assert "`queue_full`" in readme.read_text()
