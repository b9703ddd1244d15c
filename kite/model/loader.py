"""Load a model (`--model`): HF folder, .gguf file, or the embedded default, with KITE's attention."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kite.errors import BadInput
from kite.model.fingerprint import Fingerprints, fingerprints
from kite.model.cpu_products import install_cpu_products
from kite.model.fused import fuse_forward
from kite.model.geometry import Geometry, geometry_from_config
from kite.model.sources import ModelSource, hf_folder, resolve

DTYPES = ("fp32", "fp16", "bf16")


@dataclass
class LoadedModel:
    """A ready model: `model` (HF causal LM, eval mode), its tokenizer and facts about it."""

    model: Any
    tokenizer: Any
    source: ModelSource
    folder: Path
    geometry: Geometry
    adapter_dir: Path | None = None
    load_ms: float = 0.0
    _fp: Fingerprints | None = field(default=None, repr=False)

    @property
    def fingerprints(self) -> Fingerprints:
        if self._fp is None:
            self._fp = fingerprints(self.folder, self.adapter_dir)
        return self._fp

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    @contextlib.contextmanager
    def reading(self, on: bool) -> Iterator[bool]:
        """The reader adapter switched on inside when ``on`` (a state made for it is being read) and
        the model has one; yields whether it is on. Off again after (the model's default)."""
        if not on or self.adapter_dir is None:
            yield False
            return
        self.model.base_model.enable_adapter_layers()
        try:
            yield True
        finally:
            self.model.base_model.disable_adapter_layers()

    def eos_ids(self) -> set[int]:
        """Token ids that end generation: config, generation config and the chat end marker."""
        ids: set[int] = set()
        for src in (self.model.config, getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(marker)
            if isinstance(tid, int) and tid != getattr(self.tokenizer, "unk_token_id", None) and tid >= 0:
                ids.add(tid)
        return ids


def load_config_only(spec: str | None, progress=None):
    """The model's HF config without loading weights (converts a GGUF once if needed)."""
    from transformers import AutoConfig

    source = resolve(spec)
    folder = hf_folder(source, progress=progress)
    return source, folder, AutoConfig.from_pretrained(folder)


def load_model(spec: str | None = None, *, adapter: str | Path | None = None, dtype: str | None = None,
               device: str | None = None, progress=None) -> LoadedModel:
    """Load `spec` (default: the embedded SmolLM2-135M) for inference with KITE's attention.

    dtype: fp32 (default on CPU) | bf16 (default on CUDA) | fp16. device: cpu | cuda[:N].
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kite.runtime.attention import register

    hf_logging.disable_progress_bar()  # KITE reports its own progress
    hf_logging.set_verbosity_error()

    t0 = time.perf_counter()
    source = resolve(spec)
    folder = hf_folder(source, progress=progress)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bf16" if str(device).startswith("cuda") else "fp32")
    if dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation=register())
    adapter_dir = None
    if adapter is not None:
        adapter_dir = Path(adapter).expanduser().resolve()
        if not (adapter_dir / "adapter_config.json").exists():
            raise BadInput(f"--adapter {adapter}: not a peft adapter folder (no adapter_config.json)")
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
        # a reader adapter (kite upcycle train): on only while the model reads a state made for it
        model.base_model.disable_adapter_layers()
    model.to(device).eval()
    # on a GPU: fewer, fused kernels in the forward (one-kernel RMSNorm and RoPE, q/k/v and gate/up as
    # one product each); on the CPU: the products of a decode step's rows and a short prompt's tokens
    # through the native runtime (kite.model.cpu_products)
    fuse_forward(model)
    if torch.device(device).type == "cpu":
        install_cpu_products(model)
    geometry = geometry_from_config(model.config)
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, folder=folder,
                       geometry=geometry, adapter_dir=adapter_dir,
                       load_ms=(time.perf_counter() - t0) * 1e3)


@functools.lru_cache(maxsize=2)
def load_cached(spec: str | None = None, dtype: str | None = None) -> LoadedModel:
    """One loaded copy per (spec, dtype) per process: tests and the server share it."""
    return load_model(spec, dtype=dtype)
