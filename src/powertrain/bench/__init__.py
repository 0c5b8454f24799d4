"""Benchmarks: each prints a table and regenerates its section of BENCHMARKS.md."""
