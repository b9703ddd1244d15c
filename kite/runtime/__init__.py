"""The runtime: KITE's attention hook, the KV cache with per-layer prefixes, and generation."""
