"""Benchmarks run by `megarl bench ...`."""
