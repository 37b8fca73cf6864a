"""Benchmarks behind ``dcr bench``: `codec`, `construct` (owner side), `apply` (receiver side)
and `refit` (end to end). Each prints a table and writes JSON (docs/benchmarks.md)."""
