"""Generation on top of the cache layer: loading, prompt cache policy, streaming."""
