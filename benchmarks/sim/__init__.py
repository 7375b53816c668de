"""The in-process simulator behind benchmarks/algorithms.py (and the tests of the maths it runs)."""
