"""Benchmarks (run as scripts; the tests import some of them as benchmarks.<folder>.<name>)."""
