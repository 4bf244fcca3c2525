"""Benchmarks behind `kvpool bench …` (imported by nothing else; the report format is `kvpool.report`)."""
