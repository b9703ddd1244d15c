"""Upcycle: capture, compress and reload a document's KV cache as a reusable state."""

from kite.upcycle.codec import settings_for as codec_settings
from kite.upcycle.compress import CompressSettings, compress_document
from kite.upcycle.load import load_prefix
from kite.upcycle.settings import load_upcycle_config
from kite.upcycle.tagging import (
    ClauseTagger,
    QueryHead,
    TagResult,
    build_tagger,
    calibration_set,
    describe_tagger,
    evaluate_queries,
    evaluate_tagging,
)

__all__ = ["ClauseTagger", "CompressSettings", "QueryHead", "TagResult", "build_tagger",
           "calibration_set", "codec_settings", "compress_document", "describe_tagger",
           "evaluate_queries", "evaluate_tagging", "load_prefix", "load_upcycle_config"]
