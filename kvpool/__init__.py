"""kvpool: a disaggregated KV-cache pool for LLM serving (global radix index, CPU store nodes, UCX)."""

__version__ = "0.1.0"
