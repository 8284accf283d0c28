"""The process's dashboard history, the one the dashboard and `/metrics` count into and read.

Three parts, each with its job:

- routing/ops/history_rings.py: the rings of per-step counts in memory (`History`): each
  finished request counted in the step it finished, each host's load sampled, windows, cards
  and the 24 hours read from them;
- routing/ops/history_rows.py: the reader of the Request rows (`read_steps`), which fills the
  rings with the past at a restart, and the 24 hours' minutes older than an hour
  (`DatabaseHistory`);
- routing/ops/history_sampler.py: the task that samples each host's load every second and has
  the rings rebuilt from the rows once.

A step's counts and how they read (chart points, cards) are routing/ops/history_steps.py.
"""

from __future__ import annotations

from routing.ops import history_sampler
from routing.ops.history_rings import History
from routing.ops.history_rows import DatabaseHistory
from routing.runtime import Runtime

history = History()
database_history = DatabaseHistory()


def ensure_sampler(runtime: Runtime) -> None:
    """Sample `runtime`'s hosts into the process's history from now on, and rebuild it from the
    rows once; call on the runtime's loop (cheap once started)."""
    history_sampler.ensure_sampler(runtime, history)


def sampling(runtime: Runtime) -> bool:
    """Whether the process's history is sampled from `runtime`."""
    return history_sampler.sampling(runtime)
