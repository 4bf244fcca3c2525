"""The prefill node: prefix match, load, compute the suffix, publish."""
