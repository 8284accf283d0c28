"""First-run setup for `make run`: an admin account, and the fleet from crossbar.toml."""

from __future__ import annotations

import io
import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from routing.config.validation import config_from_db, config_problems


class Command(BaseCommand):
    help = (
        "Create the `admin` superuser on first run, and load crossbar.toml (or $CROSSBAR_CONFIG) "
        "when its content changed since it was last loaded."
    )

    def handle(self, *args: object, **options: object) -> str:
        lines = [self._ensure_admin()]
        config = Path(os.environ.get("CROSSBAR_CONFIG") or settings.BASE_DIR / "crossbar.toml")
        if config.is_file():
            # Only a changed file is loaded: loading it at every start would revert each edit
            # made in the admin since (crossbar_config load records what it loaded).
            shown = (
                os.path.relpath(config) if config.resolve().is_relative_to(Path.cwd()) else config
            )
            loaded = call_command(
                "crossbar_config", "load", "--if-changed", str(shown), stdout=io.StringIO()
            )
            lines.append(loaded)
        else:
            lines.append(f"No {config.name}: add hosts and routes in the admin.")
        # Said here, once per `make run`: a load says them itself, and the system checks do
        # not (they would at each of its commands).
        if not lines[-1].startswith("loaded "):
            lines += map(str, config_problems(*config_from_db()))
        return "\n".join(lines)

    def _ensure_admin(self) -> str:
        users = get_user_model()
        if users.objects.filter(username="admin").exists():
            return "Admin user: admin (exists)."
        password = os.environ.get("CROSSBAR_ADMIN_PASSWORD")
        generated = not password
        password = password or secrets.token_urlsafe(12)
        users.objects.create_superuser("admin", "", password)
        if generated:
            # Printed once, on the first run only; it is stored hashed and never again shown.
            return f"Created admin user: admin / {password} (save it now; it is not shown again)."
        return "Created admin user: admin (password from CROSSBAR_ADMIN_PASSWORD)."
