"""aotforge's benchmarks (not tests): run them with ``python -m aotforge bench``."""
