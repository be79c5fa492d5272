"""Benchmarks: each prints a table, a JSON line, and last a headline ratio against the plain baseline."""
