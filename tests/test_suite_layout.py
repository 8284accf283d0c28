"""The suite's own layout: each test module stands alone.

A test module imports helpers from `tests/helpers/` (or the fakes in `tests/fakes/`), never
from another test module or a conftest: a helper kept in a test module is found only by whoever
reads that module, is changed for its tests alone, and ties the two modules together. Fixtures
live in the nearest conftest.py, where pytest finds them without an import.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(TESTS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Each module `source` (the text of `module`) imports, by absolute name, with its line.
    `from a import b` counts both `a` and `a.b`, since `b` may be a module."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def is_test_module(name: str) -> bool:
    last = name.rpartition(".")[2]
    return name.startswith("tests.") and (last.startswith("test_") or last == "conftest")


def imports_of_test_modules() -> list[str]:
    """`file:line: module` for each import of a test module or a conftest in tests/."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        names = imported(path.read_text(), module_name(path), path.name == "__init__.py")
        found += [
            f"{path.relative_to(TESTS.parent)}:{line}: {name}"
            for line, name in names
            if is_test_module(name)
        ]
    return found


def test_no_test_module_imports_another_test_module_or_a_conftest() -> None:
    assert imports_of_test_modules() == []


def test_the_check_sees_absolute_relative_and_whole_module_imports() -> None:
    here = "tests.proxy.test_relay"
    seen = {
        "from tests.proxy.test_faults import URL": "tests.proxy.test_faults",
        "from tests.conftest import wait_until": "tests.conftest",
        "from .test_faults import URL": "tests.proxy.test_faults",
        "from ..core.test_tee import streams": "tests.core.test_tee",
        "from . import conftest": "tests.proxy.conftest",
        "import tests.core.test_placement": "tests.core.test_placement",
        "from tests.helpers.waits import wait_until": None,
        "from tests.fakes.llama_server import FakeLlamaServer": None,
    }
    for line, expected in seen.items():
        found = [name for _, name in imported(line, here) if is_test_module(name)]
        assert found == ([expected] if expected else []), line
