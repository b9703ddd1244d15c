"""KITE inside other engines: vLLM's KV connector (:mod:`kite.integrations.vllm`)."""
