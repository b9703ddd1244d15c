"""A GGUF file converted once into a cached safetensors folder: `KITE_CACHE/models/<stem>-<key>/`.

The key is the file's path, size and mtime, so a changed file converts again. What is converted is
the model's bytes: a GGUF carrying KITE's own `kite.` keys (states, `kite gguf embed`) is converted
from a copy without them (they are not the model's, and transformers reads every metadata string
byte by byte, so states would slow the conversion by their size: docs/PERFORMANCE.md). A file whose
model bytes are those of a file converted before (the same model with states embedded, or a copy)
gets that folder (a link to it) instead of a second conversion: the same bytes convert to the same
folder, and the sha256 of both is compared before it is shared.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kite.errors import BadInput
from kite.paths import cache_dir

SOURCE_RECORD = "kite-source.json"   # in a converted folder: what it was converted from


def converted_gguf_folder(gguf: Path, progress=None) -> Path:
    """The safetensors (fp32) folder of `gguf`, converted now if this file's is not cached."""
    target = cache_dir() / "models" / f"{gguf.stem}-{_cache_key(gguf)}"
    if _finished(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.src.", dir=target.parent) as scratch:
        source = _without_kite_keys(gguf, Path(scratch))
        same = _converted_before(source, gguf, target.parent)
        if same is not None:
            _link(target, same)
            return target
        if progress:
            progress(f"converting {gguf.name} to safetensors (once; cached in {target.parent})")
        tokenizer, model = _read_gguf_model(gguf, source)
        _save_converted(gguf, source, model, tokenizer, target)
    return target


def _cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def _without_kite_keys(gguf: Path, scratch: Path) -> Path:
    """`gguf` itself, or when it carries `kite.` keys a copy of it in `scratch` without them."""
    from kite.model.gguf import copy_gguf, is_kite_key, open_gguf

    reader = open_gguf(gguf)
    if not any(is_kite_key(name) for name in reader.fields):
        return gguf
    copy = scratch / gguf.name
    copy_gguf(reader, copy, drop=is_kite_key)
    return copy


def _sha256(path: Path, cached: bool) -> str:
    """The file's sha256; remembered by path, size and mtime when `cached` (a file that stays)."""
    from kite.model.fingerprint import _file_digest

    if cached:
        return _file_digest(path).hex()
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _converted_before(source: Path, gguf: Path, models: Path) -> Path | None:
    """A converted folder in `models` made from the same bytes as `source` (`gguf`, or its copy
    without KITE's keys), else None. Only folders converted from a file of the same size are
    hashed (their file as it was converted, or the sha256 they recorded)."""
    size = source.stat().st_size
    digest = None
    for record in sorted(models.glob(f"*/{SOURCE_RECORD}")):
        folder = record.parent
        if folder.is_symlink():
            continue
        try:
            rec = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("source_size", rec.get("size")) != size:
            continue
        theirs = rec.get("source_sha256")
        if theirs is None:  # recorded before the sha256 was: their file, if it is unchanged
            other = Path(rec.get("gguf", ""))
            try:
                st = other.stat()
            except OSError:
                continue
            if (st.st_size, st.st_mtime_ns) != (rec.get("size"), rec.get("mtime_ns")):
                continue
            theirs = _sha256(other, cached=True)
        digest = digest or _sha256(source, cached=source == gguf)
        if theirs == digest:
            return folder
    return None


def _link(target: Path, folder: Path) -> None:
    """`target` as a link to the converted `folder` (made beside it and renamed into place)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(folder.name, tmp)
    if _finished(target):  # another process finished it meanwhile
        tmp.unlink()
        return
    if target.is_dir() and not target.is_symlink():  # a half-finished earlier conversion
        shutil.rmtree(target)
    os.replace(tmp, target)


def _finished(target: Path) -> bool:
    """Whether `target` is a whole converted folder (its record is written last, inside the folder
    renamed into place)."""
    return (target / SOURCE_RECORD).exists()


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


def _save_converted(gguf: Path, source: Path, model, tokenizer, target: Path) -> None:
    # The weights are dequantized to plain fp32 now: save them as an ordinary model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        st = gguf.stat()
        record = {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if source != gguf:  # converted from a copy without KITE's keys: the bytes converted
            record.update(source_size=source.stat().st_size, source_sha256=_sha256(source, cached=False))
        (tmp / SOURCE_RECORD).write_text(json.dumps(record))
        if _finished(target):  # another process converted the same file meanwhile: keep its folder
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if target.is_symlink():  # a link to a folder since removed
            target.unlink()
        elif target.exists():  # a half-finished earlier conversion: no kite-source.json in it
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:  # another process put its finished folder there first
            if not _finished(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
