"""Benchmarks: scripts that print their figures (never timed tests)."""
