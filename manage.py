#!/usr/bin/env python
"""Django's command-line utility for crossbar."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crossbar_site.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as error:  # a bad setting: what is wrong, not a traceback
        sys.exit(f"crossbar: {error}")


if __name__ == "__main__":
    main()
