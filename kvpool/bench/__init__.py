"""Benchmarks behind `kvpool bench …` and the shared JSON report format of DESIGN.md."""
