"""Tiny random models for the tests: :mod:`kite.testing.tiny_models` (benchmarks make them too)."""

from kite.testing.tiny_models import CHAT_TEMPLATE, CORPUS, make_tiny_model, tiny_config, tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "CORPUS", "load_tiny_llama", "make_tiny_model", "tiny_config", "tiny_tokenizer"]


def load_tiny_llama(tiny_models):
    """The tiny Llama of the ``tiny_models`` fixture, loaded on the CPU, torch at one thread (a
    server's batch thread is its only torch thread): what the server tests' ``lm`` fixtures give."""
    import torch

    from kite.model import load_model

    torch.set_num_threads(1)
    return load_model(str(tiny_models["llama"]), device="cpu")
