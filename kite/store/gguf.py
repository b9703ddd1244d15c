"""States embedded in a GGUF model file: the model and the states made with it, shipped as one file.

Each state is two string keys of the GGUF's metadata (docs/upc-format.md, "Embedded in a GGUF"):

    kite.upc.<id>        the .upc file's bytes, one zstd frame, base64 (a GGUF string is UTF-8 text)
    kite.upc_meta.<id>   JSON: labels, tokens, clusters, fingerprints, sizes, the .upc's sha256

Strings, not tensors or byte arrays: llama.cpp refuses a file with tensors its architecture does not
name, and `gguf`'s reader (transformers' too) walks an array element by element (minutes for MBs),
while a string is one slice. An embedded state is read back byte for byte (its sha256 is checked).
Only states of the GGUF's own model are embedded (their fingerprints are checked against it:
kite/store/gguf_embed.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kite.errors import BadInput, KiteError
from kite.store.ids import check_state_id

STATE_KEY = "kite.upc."        # + id: the state's bytes (zstd frame, base64)
META_KEY = "kite.upc_meta."    # + id: its JSON metadata
EMBED_FORMAT = "kite-upc-gguf"
EMBED_VERSION = 1
ZSTD_LEVEL = 3
# llama.cpp refuses a GGUF string longer than this (GGUF_MAX_STRING_LENGTH, 1 GiB)
MAX_STRING_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class EmbeddedState:
    """One state in a GGUF file: its id, its metadata (the `kite.upc_meta.<id>` JSON) and how many
    bytes it takes in the file (`stored_bytes`, the base64 text)."""

    id: str
    meta: dict[str, Any]
    stored_bytes: int

    @property
    def upc_bytes(self) -> int:
        return int(self.meta["bytes"])

    @property
    def sha256(self) -> str:
        return str(self.meta["sha256"])

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, **{k: v for k, v in self.meta.items() if k not in ("format", "version")},
                "stored_bytes": self.stored_bytes}


# -- reading ------------------------------------------------------------------------------------

def gguf_file(spec: str | os.PathLike[str], what: str | None = None) -> Path:
    """A GGUF file named by a path or an embedded model's name (`smollm2-135m`), checked to be one
    (BadInput otherwise, naming `what`, a flag, when given)."""
    from kite.model.gguf import check_gguf
    from kite.model.sources import EMBEDDED, embedded_gguf_path

    if str(spec) in EMBEDDED:
        return embedded_gguf_path(str(spec))
    return check_gguf(Path(spec).expanduser(), what)


def embedded_states(path: str | os.PathLike[str], reader=None) -> list[EmbeddedState]:
    """The states embedded in the GGUF file `path`, in the file's order. BadInput for a file that is
    not a GGUF, and for an embedded state whose metadata or bytes key is missing or malformed."""
    from kite.model.gguf import open_gguf

    reader = reader if reader is not None else open_gguf(path)
    return list(index_of(reader, Path(path)).values())


def index_of(reader, path: Path) -> dict[str, EmbeddedState]:
    """The embedded states of the GGUF `reader` reads (`path`: for messages), by id, in file order."""
    from kite.model.gguf import string_values

    metas = string_values(reader, META_KEY)
    datas = {name.removeprefix(STATE_KEY): name for name in reader.fields if name.startswith(STATE_KEY)}
    out: dict[str, EmbeddedState] = {}
    for key, text in metas.items():
        sid = key.removeprefix(META_KEY)
        where = f"{path}: embedded state {sid!r}"
        try:
            check_state_id(sid)
        except BadInput as exc:
            raise BadInput(f"{path}: {exc}") from None
        try:
            meta = json.loads(text)
        except ValueError:
            raise BadInput(f"{where}: its metadata ({key}) is not JSON") from None
        if not isinstance(meta, dict) or meta.get("format") != EMBED_FORMAT:
            raise BadInput(f"{where}: its metadata ({key}) is not KITE's ({EMBED_FORMAT!r} expected)")
        if not isinstance(meta.get("version"), int) or not isinstance(meta.get("bytes"), int):
            raise BadInput(f"{where}: its metadata ({key}) has no embedding version or size")
        if meta["version"] > EMBED_VERSION:
            raise BadInput(f"{where}: embedded with a newer KITE (embedding version {meta['version']}; this "
                           f"KITE reads {EMBED_VERSION}); upgrade KITE")
        if sid not in datas:
            raise BadInput(f"{where}: its bytes ({STATE_KEY}{sid}) are missing")
        stored = reader.fields[datas.pop(sid)]
        out[sid] = EmbeddedState(sid, meta, int(stored.parts[-1].nbytes))
    if datas:
        sid = next(iter(datas))
        raise BadInput(f"{path}: embedded state {sid!r} has no metadata ({META_KEY}{sid})")
    return out


def find_state(path: str | os.PathLike[str], state_id: str, reader=None, what: str = "--state") -> EmbeddedState:
    """The embedded state `state_id` of the GGUF `path`, else BadInput naming the ids it has."""
    from kite.model.gguf import open_gguf

    path = Path(path)
    reader = reader if reader is not None else open_gguf(path)
    index = index_of(reader, path)
    if state_id not in index:
        raise BadInput(f"{what} {state_id}: {path.name} embeds no state {state_id!r} ({_listing(index)})")
    return index[state_id]


def _listing(index: dict[str, EmbeddedState]) -> str:
    if not index:
        return "it embeds none; `kite gguf embed` adds them"
    ids = sorted(index)
    shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
    return f"it embeds: {shown}"


def read_state(path: str | os.PathLike[str], state_id: str, reader=None) -> tuple[EmbeddedState, bytes]:
    """The embedded state `state_id` and its `.upc` bytes, exactly as they were embedded (length and
    sha256 checked: BadInput for a corrupt one)."""
    import zstandard

    from kite.model.gguf import open_gguf

    path = Path(path)
    reader = reader if reader is not None else open_gguf(path)
    state = find_state(path, state_id, reader)
    where = f"{path}: embedded state {state_id!r}"
    text = reader.fields[STATE_KEY + state_id].parts[-1]
    try:
        frame = base64.b64decode(text.tobytes(), validate=True)
        data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=state.upc_bytes)
    except (binascii.Error, ValueError, zstandard.ZstdError) as exc:
        raise BadInput(f"{where}: corrupt ({exc})") from None
    if len(data) != state.upc_bytes or hashlib.sha256(data).hexdigest() != state.sha256:
        raise BadInput(f"{where}: corrupt (its bytes do not match the sha256 its metadata records)")
    return state, data


def extract_state(path: str | os.PathLike[str], state_id: str, dest: str | os.PathLike[str]) -> EmbeddedState:
    """Write the embedded state `state_id` to `dest` (atomically), byte for byte as embedded."""
    from kite.atomic import write_bytes

    state, data = read_state(path, state_id)
    write_bytes(dest, data)
    return state


def cached_state(path: str | os.PathLike[str], state_id: str, reader=None) -> Path:
    """The embedded state `state_id` as a `.upc` file that loaders can open: extracted once into
    `KITE_CACHE/gguf_states/<sha256>.upc` (named by its content, so it is shared by every GGUF that
    embeds the same state) and reused while its bytes still match."""
    from kite.model.gguf import open_gguf

    reader = reader if reader is not None else open_gguf(path)
    state = find_state(path, state_id, reader)
    target = _cache_folder() / f"{state.sha256}.upc"
    if not _holds(target, state):
        from kite.atomic import write_bytes

        write_bytes(target, read_state(path, state_id, reader)[1])
    return target


def cached_states(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Every embedded state of the GGUF `path` as a cached `.upc` file (`cached_state`), by id."""
    from kite.model.gguf import open_gguf

    reader = open_gguf(path)
    return {s.id: cached_state(path, s.id, reader) for s in embedded_states(path, reader)}


def _cache_folder() -> Path:
    from kite.paths import cache_dir

    return cache_dir() / "gguf_states"


def _holds(target: Path, state: EmbeddedState) -> bool:
    try:
        if target.stat().st_size != state.upc_bytes:
            return False
        with open(target, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest() == state.sha256
    except OSError:
        return False


def state_path(spec: str | os.PathLike[str], model: str | None, what: str = "--upc") -> Path:
    """What `--upc SPEC` names, with `--model MODEL`: a `.upc` file when SPEC is a path that exists,
    else (the model being a .gguf file) the state SPEC embedded in it, as its cached `.upc` file.
    Any other SPEC comes back as a path, for the state reader to refuse."""
    from kite.model.sources import resolve

    path = Path(spec).expanduser()
    if path.exists():
        return path
    source = resolve(model)
    if source.kind != "gguf":  # the embedded models' files embed no states
        return path
    from kite.model.gguf import open_gguf

    reader = open_gguf(source.path)
    index = index_of(reader, source.path)
    if str(spec) not in index:
        raise BadInput(f"{what} {spec}: no such state file, and {source.path.name} embeds no state {str(spec)!r} "
                       f"({_listing(index)})")
    return cached_state(source.path, str(spec), reader)


def state_keys(sid: str, meta: dict, data: bytes, path: Path) -> tuple[EmbeddedState, dict[str, str]]:
    """The two GGUF keys of the state `sid` (bytes `data`, header `meta`, read from `path`): its bytes as
    one zstd frame in base64 and its metadata as JSON; and the EmbeddedState they make."""
    import zstandard

    text = base64.b64encode(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)).decode("ascii")
    if len(text) > MAX_STRING_BYTES:
        raise KiteError(f"{path}: too large to embed ({len(text):,} bytes of text once encoded; a GGUF string "
                        f"holds at most {MAX_STRING_BYTES:,} in llama.cpp)")
    fps = meta.get("fingerprints") or {}
    info = {
        "format": EMBED_FORMAT, "version": EMBED_VERSION,
        "compression": "zstd", "encoding": "base64",
        "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
        "tokens": int(meta["n_tokens"]),
        "labels": sorted({c["label"] for c in meta.get("clusters", [])}),
        "clusters": len(meta.get("clusters", [])),
        "fingerprint": fps.get("combined"),
        "fingerprints": fps,
        "codec": (meta.get("codec") or {}).get("name"),
        "source": (meta.get("source") or {}).get("name"),
        "created_at": meta.get("created_at"),
        "file": path.name,
    }
    return (EmbeddedState(sid, info, len(text)),
            {STATE_KEY + sid: text, META_KEY + sid: json.dumps(info, separators=(",", ":"), ensure_ascii=False)})
