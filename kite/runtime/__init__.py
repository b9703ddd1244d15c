"""The runtime: KITE's attention hook, the KV cache with per-layer prefixes, generation, and
batched decoding of many sequences that each carry their own state."""
