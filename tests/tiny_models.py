"""Tiny random models for the tests: :mod:`kite.testing.tiny_models` (benchmarks make them too)."""

from kite.testing.tiny_models import CHAT_TEMPLATE, CORPUS, make_tiny_model, tiny_config, tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "CORPUS", "make_tiny_model", "tiny_config", "tiny_tokenizer"]
