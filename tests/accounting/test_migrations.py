"""The migrations in the repository make the tables the models describe."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_the_models_need_no_migration_the_repository_lacks() -> None:
    out = io.StringIO()

    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out)
    except SystemExit:
        pytest.fail(f"a model change has no migration:\n{out.getvalue()}")
