"""Hypothesis's settings for a mutation run, loaded as a pytest plugin by `make mutants`
(`-p tests.mutation.hypothesis_settings` in pyproject.toml's [tool.mutmut]).

No shrinking: the first failing example kills a mutant, and shrinking it (seconds for the
stateful model of the request path) would only slow the run. No example database: an example
that killed one mutant is not replayed against the next, so a score depends only on the code,
the tests and the fixed seed. Loaded before the test modules are imported, so the settings
they declare (`max_examples`, ...) are applied on top of these.
"""

from __future__ import annotations

from hypothesis import Phase, settings

settings.register_profile(
    "mutants", database=None, phases=[Phase.explicit, Phase.reuse, Phase.generate]
)
settings.load_profile("mutants")
