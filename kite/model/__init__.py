"""Models: sources (HF folder, GGUF, embedded), geometry, fingerprints, loading."""

from kite.model.facts import ModelFacts
from kite.model.geometry import Geometry, geometry_from_config
from kite.model.loader import LoadedModel, load_cached, load_config_only, load_model

__all__ = ["Geometry", "LoadedModel", "ModelFacts", "geometry_from_config", "load_cached", "load_config_only", "load_model"]
