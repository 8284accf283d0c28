"""The configuration's problems as Django system checks (`manage.py check`).

Unlike most system checks this one reads the database: the problems it reports are in the
rows, not the code. Every problem is reported at Warning level, the ones `crossbar_config`
treats as errors included (their ids keep the E: `crossbar.E004`). An Error would make Django
refuse to run `migrate`, `runserver` and every other command until the rows are fixed, so one
route with a bad default model would keep the whole gateway, and the admin that could fix it,
from starting. As Django's own checks that read a database, it runs only when asked for one:
`manage.py check --database default` (`--fail-level WARNING` exits non-zero on them) and
`migrate`; otherwise every command would repeat them (`make run` runs four). `make run` says
them once, through `crossbar_setup`.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.apps import AppConfig
from django.core.checks import CheckMessage, Warning
from django.db import DatabaseError

from routing.config.validation import config_from_db, config_problems


def check_configuration(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: object,
) -> list[CheckMessage]:
    """One Warning per configuration problem, with the problem's code: `crossbar.E004`; none
    unless `databases` are given."""
    if not databases:
        return []
    if app_configs is not None and not {"hosts", "routing"} & {a.label for a in app_configs}:
        return []
    try:
        problems = config_problems(*config_from_db())
    except DatabaseError:
        # Django runs the checks before `migrate` too, when there may be no tables yet.
        return []
    return [
        Warning(problem.message, obj=problem.key, id=f"crossbar.{problem.code}")
        for problem in problems
    ]
