"""Upcycle: capture, compress and reload a document's KV cache as a reusable state."""

from kite.upcycle.codec import settings_for as codec_settings
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.load import load_prefix
from kite.upcycle.settings import load_upcycle_config
from kite.upcycle.tagger_setup import build_tagger

__all__ = ["CompressSettings", "build_tagger", "codec_settings", "compress_document", "load_prefix",
           "load_upcycle_config"]
