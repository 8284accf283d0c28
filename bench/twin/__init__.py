"""A twin of a llama.cpp fleet in virtual time (bench/twin/README.md). Run with bench/ on the
path, as bench/'s scripts import their siblings: `PYTHONPATH=bench python -m twin` (`make twin`)."""
