"""The decode node: pull or recompute the prompt KV, decode, stream tokens, publish."""
