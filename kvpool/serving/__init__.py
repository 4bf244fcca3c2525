"""Pieces shared by the serving nodes (prefill and decode): settings, request validation, sampling seeds."""
