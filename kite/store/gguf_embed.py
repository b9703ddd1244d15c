"""Embedding states in a GGUF model file (`kite gguf embed`): every state checked (whole, and made by
the file's model), then the model file copied with each state's two keys added (the keys and their
encoding: `state_keys` in kite/store/gguf.py, docs/upc-format.md "Embedded in a GGUF")."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kite.errors import BadInput, FingerprintMismatch
from kite.store.gguf import EmbeddedState, gguf_file, index_of, state_keys
from kite.store.ids import check_state_id

@dataclass(slots=True)
class EmbedReport:
    """What `embed_states` wrote: the output, the model's fingerprint, the states added and those
    the model file already held, sizes (bytes) and the time it took (ms)."""

    output: Path
    model: Path
    model_fingerprint: str
    added: list[EmbeddedState]
    kept: list[str] = field(default_factory=list)
    model_bytes: int = 0
    output_bytes: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(output=str(self.output), model=str(self.model), added=[s.to_dict() for s in self.added])
        return d


def embed_states(model: str | os.PathLike[str], states: Sequence[tuple[str, str | os.PathLike[str]]],
                 dest: str | os.PathLike[str], *, progress: Callable[[str], None] | None = None) -> EmbedReport:
    """Write `dest`: the GGUF `model` (its tensors and metadata, copied with the `gguf` package's
    writer) with each `(id, .upc path)` of `states` added under `kite.upc.<id>`; states the model file
    already embeds are kept. Every state is checked first, before anything is written: its id (a plain
    name, new to the file), its file (header, size, every part's checksum) and its fingerprints against
    the model's, the ones `kite model info --model MODEL` prints (FingerprintMismatch naming both).
    The write is atomic; `dest` may be `model` itself."""
    from kite.model.gguf import open_gguf

    t0 = time.perf_counter()
    model = gguf_file(model)
    if not states:
        raise BadInput("no state to embed: name one or more .upc files")
    reader = open_gguf(model)
    present = index_of(reader, model)
    ids = [check_state_id(sid) for sid, _ in states]
    for sid in ids:
        if ids.count(sid) > 1:
            raise BadInput(f"state id {sid!r} is given twice; name each state once (ID=PATH sets its id)")
        if sid in present:
            raise BadInput(f"{model.name} already embeds a state {sid!r}; give this one another id (ID=PATH)")
    opened = [(sid, Path(p), _read_upc(Path(p))) for sid, p in states]
    t1 = time.perf_counter()
    fps = _model_fingerprints(model, progress)
    for _sid, path, (meta, _data) in opened:
        check_made_by(meta, fps, path, model)
    t2 = time.perf_counter()
    added, extra = [], {}
    for sid, path, (meta, data) in opened:
        state, fields = state_keys(sid, meta, data, path)
        added.append(state)
        extra.update(fields)
    t3 = time.perf_counter()
    if progress:
        progress(f"writing {Path(dest).name}: {model.name} + {len(added)} state{'s' if len(added) != 1 else ''}")
    model_bytes = model.stat().st_size
    from kite.model.gguf import copy_gguf

    written = copy_gguf(reader, dest, add=extra)
    t4 = time.perf_counter()
    steps = {"check_states": t1 - t0, "fingerprint": t2 - t1, "encode": t3 - t2, "write": t4 - t3}
    return EmbedReport(Path(dest), model, fps.combined, added, kept=list(present), model_bytes=model_bytes,
                       output_bytes=written, timings_ms={k: round(s * 1e3, 1) for k, s in steps.items()})


def _read_upc(path: Path) -> tuple[dict, bytes]:
    """A state's header and bytes, the state checked whole (header, size, every part's checksum)."""
    from kite.upcycle import StateFile

    with StateFile(path) as sf:
        bad = {k: v for k, v in sf.verify().items() if v != "ok"}
        if bad:
            key = next(iter(bad))
            raise BadInput(f"{path}: {len(bad)} part{'s' if len(bad) != 1 else ''} fail their checksum "
                           f"(first: {key}: {bad[key]}); `kite upcycle inspect {path} --verify` lists them")
        data = os.pread(sf.fileno(), sf.file_size, 0)  # the file just checked, even if renamed over since
        return dict(sf.meta), data


def _model_fingerprints(model: Path, progress):
    """The fingerprints of the GGUF's model: those of its converted folder, as `kite model info`."""
    from kite.model.fingerprint import fingerprints
    from kite.model.convert import converted_gguf_folder

    return fingerprints(converted_gguf_folder(model, progress=progress))


def check_made_by(meta: dict, fps, path: Path, model: Path) -> None:
    """FingerprintMismatch (one line, both fingerprints) unless the state whose header is `meta` was
    made by the model `fps` are the fingerprints of: the same weights and tokenizer (a state made for
    a reader adapter keeps it: it loads with that adapter on). A state migrated with only the new
    model's combined fingerprint known is compared by that."""
    from kite.model.fingerprint import PREFIX
    from kite.shortid import apart

    have = meta.get("fingerprints") or {}
    combined = have.get("combined") or ""
    if have.get("model") is None and have.get("migrated_from"):
        if fps.combined.removeprefix(PREFIX).startswith(combined.removeprefix(PREFIX)) and combined:
            return
        part = "combined"
    else:
        part = next((p for p in ("model", "tokenizer") if have.get(p) != getattr(fps, p)), None)
        if part is None:
            return
    detail = "" if part == "combined" else (" ({} fingerprint {} ≠ {})".format(
        part, *apart(have.get(part), getattr(fps, part))))
    made_by, is_model = apart(combined, fps.combined)
    raise FingerprintMismatch(
        f"{path}: made by model {made_by}, but {model.name} is model {is_model}"
        f"{detail}; embed states made with this model (kite upcycle compress --model {model}), or migrate "
        f"them to it (kite upcycle migrate)")
