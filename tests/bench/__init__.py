"""Smoke runs of the benchmarks (small sizes; the numbers live in docs/benchmarks.md)."""
