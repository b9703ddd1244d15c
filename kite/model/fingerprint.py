"""Model fingerprints (`kite-fp1:<hex>`): which model, tokenizer and adapter made a state.

sha256 over the canonical architecture config, the tokenizer's vocabulary and merges, and the
weights' bytes (streamed). Weight hashes are cached by path + size + mtime, so a second call on a
15 GB model does not rehash.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kite.paths import cache_dir

PREFIX = "kite-fp1:"
# Config fields that decide what the model computes; names, paths and dtype do not.
_ARCH_KEYS = (
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
    "rms_norm_eps", "hidden_act", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "rope_parameters", "rope_scaling", "rope_theta", "sliding_window", "use_sliding_window",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


@dataclass(frozen=True, slots=True)
class Fingerprints:
    """The parts a state records. `combined` is what `kite model info` prints."""

    model: str
    tokenizer: str
    adapter: str | None
    combined: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def base(self) -> str:
        """The combined fingerprint of the weights and tokenizer alone (no adapter): what the KV a
        model computes depends on, since a reader adapter is off while a document is captured."""
        return combine(self.model, self.tokenizer, None)


def combine(model: str, tokenizer: str, adapter: str | None) -> str:
    h = hashlib.sha256(b"kite-fp1\0")
    for part in (model, tokenizer, adapter or "-"):
        h.update(part.encode() + b"\0")
    return _fmt(h)


def short(fp: str) -> str:
    """The short form: the first 12 hex digits."""
    return fp.removeprefix(PREFIX)[:12]


def _fmt(h: "hashlib._Hash") -> str:
    return PREFIX + h.hexdigest()


def arch_digest(config_dict: dict[str, Any]) -> bytes:
    canon = {k: config_dict[k] for k in _ARCH_KEYS if config_dict.get(k) is not None}
    return json.dumps(canon, sort_keys=True, default=str).encode()


def tokenizer_fingerprint(folder: Path) -> str:
    """sha256 over the tokenizer's vocabulary and merges (tokenizer.json model section)."""
    tj = folder / "tokenizer.json"
    if tj.exists():
        return _cached(tj, "tokenizer", lambda: _tokenizer_json_fp(tj))
    h = hashlib.sha256(b"tokenizer\0")
    for name in sorted(os.listdir(folder)):  # slow tokenizers: hash their vocabulary files
        if name.startswith(("vocab", "merges", "tokenizer.model", "spiece")):
            h.update(name.encode() + b"\0")
            h.update(_file_digest(folder / name))
    return _fmt(h)


def _tokenizer_json_fp(tj: Path) -> str:
    h = hashlib.sha256(b"tokenizer\0")
    data = json.loads(tj.read_text(encoding="utf-8"))
    model = data.get("model", {})
    h.update(json.dumps({"vocab": model.get("vocab"), "merges": model.get("merges"),
                         "added": [t.get("content") for t in data.get("added_tokens", [])]},
                        sort_keys=True).encode())
    return _fmt(h)


def weights_fingerprint(folder: Path) -> str:
    h = hashlib.sha256(b"weights\0")
    h.update(arch_digest(json.loads((folder / "config.json").read_text())))
    files = sorted(p for p in folder.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES)
                   and not p.name.startswith("adapter_"))
    for p in files:
        h.update(p.name.encode() + b"\0")
        h.update(_file_digest(p))
    return _fmt(h)


def adapter_fingerprint(adapter_dir: Path) -> str:
    h = hashlib.sha256(b"adapter\0")
    for p in sorted(adapter_dir.iterdir()):
        if p.name == "adapter_config.json" or p.name.endswith(".safetensors"):
            h.update(p.name.encode() + b"\0")
            h.update(_file_digest(p))
    return _fmt(h)


def fingerprints(folder: Path, adapter_dir: Path | None = None) -> Fingerprints:
    """All fingerprints of the HF folder `folder` (+ an optional peft adapter folder)."""
    model = weights_fingerprint(folder)
    tok = tokenizer_fingerprint(folder)
    adapter = adapter_fingerprint(adapter_dir) if adapter_dir else None
    return Fingerprints(model=model, tokenizer=tok, adapter=adapter, combined=combine(model, tok, adapter))


# --- streamed file hashing with a cache keyed by path, size and mtime ------------------------

def _cache_file() -> Path:
    return cache_dir() / "fingerprints.json"


def _load_cache() -> dict[str, str]:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _cached(path: Path, kind: str, compute) -> str:
    """`compute()` for `path`, remembered by (kind, path, size, mtime) when the file is big."""
    st = path.stat()
    key = f"{kind}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache = _load_cache()
    if key in cache:
        return cache[key]
    value = compute()
    if st.st_size >= 1 << 20:  # only big files are worth remembering
        from kite.atomic import write_text

        cache = _load_cache()
        cache[key] = value
        try:
            write_text(_cache_file(), json.dumps(cache))
        except OSError:
            pass  # a read-only cache only costs a rehash next time
    return value


def _file_digest(path: Path) -> bytes:
    def digest() -> str:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()

    return bytes.fromhex(_cached(path, "sha256", digest))
