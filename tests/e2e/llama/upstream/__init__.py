"""llama.cpp's own server test suite, run against llama-server directly and through crossbar.

`make llama-suite` (docs/compatibility.md); not part of `make test` or CI.
"""
