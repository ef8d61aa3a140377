"""Benchmarks: every figure is a ratio to a named baseline measured in the same run."""
