"""A twin of a llama.cpp fleet in virtual time (bench/twin/README.md)."""
