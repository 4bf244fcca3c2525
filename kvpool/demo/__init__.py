"""`kvpool demo`: a local cluster of real processes serving a RAG and a multi-turn chat workload."""
