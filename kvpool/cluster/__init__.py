"""Launching kvpool processes: a local cluster of real role processes on this host."""
