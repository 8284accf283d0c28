"""daphne's command line on a uvloop event loop: `bench_gateway.py --server daphne-uvloop`.

daphne.server creates its loop (`asyncio.new_event_loop()`) when it is imported and hands it to
Twisted's asyncio reactor, so the policy must be uvloop's before that import.
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

from daphne.cli import CommandLineInterface  # noqa: E402

if __name__ == "__main__":
    sys.exit(CommandLineInterface.entrypoint())
