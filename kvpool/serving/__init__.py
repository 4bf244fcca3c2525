"""Pieces shared by the serving nodes (prefill and decode): settings, the node runtime, metrics, sampling
seeds and the serve loop. Role-specific code lives in `prefill_node` and `decode_node`."""
