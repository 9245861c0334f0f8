"""Benchmarks: programs that print tables and write JSON."""
