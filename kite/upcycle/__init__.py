"""Upcycle: capture, compress and reload a document's KV cache as a reusable state."""
