"""Write the README's table of error codes from the code (routing/core/error_table.py).

`manage.py crossbar_error_table` rewrites it in README.md; `--check` changes nothing and exits
1 when the file's table is not the one the code gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

import routing.proxy.view  # noqa: F401  (imports every error the gateway answers)
from routing.core.error_table import with_table


def readme() -> Path:
    return Path(settings.BASE_DIR) / "README.md"


class Command(BaseCommand):
    help = "Write the table of error codes in README.md from routing/core/errors.py."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--check", action="store_true", help="only say whether it is current")

    def handle(self, *args: Any, check: bool = False, **options: Any) -> str:
        path = readme()
        text = path.read_text()
        try:
            written = with_table(text)
        except ValueError as exc:
            raise CommandError(f"{path}: {exc}") from None
        if written == text:
            return f"{path.name}: the table of error codes is current"
        if check:
            raise CommandError(f"{path.name}: the table of error codes is not current")
        path.write_text(written)
        return f"{path.name}: the table of error codes was written"
