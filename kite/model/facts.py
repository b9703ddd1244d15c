"""A model known by its folder's config, tokenizer and fingerprints, with no weights in memory.

What rebuilding a state's KV and compressing KV already computed need of a model (the KV geometry,
RoPE, the fingerprints a state is checked against and records, the tokenizer for span cutting),
for a process that holds the model's KV but not KITE's copy of the model: a serving engine's KV
connector (kite.integrations.vllm). It answers the attributes of :class:`LoadedModel` those paths
read (``geometry``, ``fingerprints``, ``model``, ``device``, ``dtype``, ``source.spec``,
``tokenizer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from kite.errors import BadInput
from kite.model.fingerprint import Fingerprints, fingerprints
from kite.model.geometry import Geometry, geometry_from_config
from kite.model.sources import ModelSource


@dataclass
class ModelFacts:
    """``folder``: the model's HF folder (config.json, tokenizer, weights for the fingerprint);
    ``dtype`` / ``device``: what rebuilt KV is cast to and put on."""

    folder: Path
    dtype: Any = None
    device: Any = "cpu"
    _fp: Fingerprints | None = field(default=None, repr=False)

    def __post_init__(self):
        import torch

        self.folder = Path(self.folder)
        if not (self.folder / "config.json").is_file():
            raise BadInput(f"model folder {self.folder}: no config.json")
        self.dtype = self.dtype or torch.float32

    @cached_property
    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.folder)

    @cached_property
    def geometry(self) -> Geometry:
        return geometry_from_config(self.config)

    @property
    def fingerprints(self) -> Fingerprints:
        if self._fp is None:
            self._fp = fingerprints(self.folder)
        return self._fp

    @property
    def model(self):
        """The config, where RoPE tables are read from a model: kite.upcycle's rope_cos_sin builds
        the model type's rotary embedding from it."""
        return self.config

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder)

    @property
    def source(self) -> ModelSource:
        return ModelSource(str(self.folder), "hf", self.folder)
