"""The `.upc` container: a small header, then one blob per part, each checksummed, readable in part.

Layout (all integers little-endian; see docs/upc-format.md):

    magic     8 bytes  b"KITEUPC\\0"
    version   u16      FORMAT_VERSION
    flags     u16      0
    hlen      u32      header length in bytes
    hsum      16 bytes blake2b-128 of the header bytes
    header    hlen bytes of UTF-8 JSON (metadata and the blob index)
    blobs     concatenated; the index gives each blob's offset from the end of the header,
              stored length, raw length, codec ("zstd" | "raw") and blake2b-128 of the stored bytes

Loading one cluster of a few layers reads the header and just those blobs. The writer records
the file it wrote as verified (:mod:`kite.upcycle.format.versions`): it computed every checksum
itself, so a loader need not hash the file again while it keeps that version.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kite.atomic import atomic_writer
from kite.errors import BadInput
from kite.upcycle.format.address import check_address
from kite.upcycle.format.header import BLOB_CODECS, check_header, content_digest
from kite.upcycle.format.signing import check_signature, signed, signing_policy
from kite.upcycle.format.versions import file_version, record_verified, records_enabled

MAGIC = b"KITEUPC\0"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<8sHHI16s")
MAX_HEADER = 64 << 20


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class BlobEntry:
    key: str
    offset: int
    length: int
    raw_length: int
    codec: str
    checksum: str

    def to_json(self) -> list:
        return [self.key, self.offset, self.length, self.raw_length, self.codec, self.checksum]

    @classmethod
    def from_json(cls, row: list) -> "BlobEntry":
        return cls(*row)


# zstd is kept where it saves at least MIN_SAVING (the smallest file). States written for GPU
# serving (compress_document on a CUDA model) ask blobs of LARGE_BLOB bytes or more for
# LARGE_MIN_SAVING instead: decompressing costs time on every load from the page cache, several
# times the read it saves, which quantized codes (only a little smaller under zstd) do not repay
# (docs/PERFORMANCE.md, "zstd and load speed").
MIN_SAVING = 0.03
LARGE_BLOB = 64 << 10
LARGE_MIN_SAVING = 0.25


class StateWriter:
    """Collect blobs, then write header + blobs atomically (invariant 4).

    A blob is stored zstd-compressed where that saves ≥ ``min_saving`` of its bytes (≥
    ``large_min_saving`` for blobs of ``large_blob`` bytes or more; the default asks the same of
    every blob, ``LARGE_MIN_SAVING`` trades file size for load speed), else raw; either reads back
    the same; ``zstd=False``: every blob raw (a state whose codec counted its bytes exactly).
    ``register``: record the written file's version as verified (the writer computed every checksum
    itself), so that loaders in any process skip re-hashing it.
    """

    def __init__(self, zstd_level: int = 3, min_saving: float = MIN_SAVING,
                 large_min_saving: float = MIN_SAVING, large_blob: int = LARGE_BLOB, register: bool = True,
                 zstd: bool = True):
        self._blobs: list[tuple[str, bytes, int, str]] = []
        self._keys: set[str] = set()
        self._level = zstd_level
        self._min_saving = float(min_saving)
        self._large_min_saving = float(large_min_saving)
        self._large_blob = int(large_blob)
        self._register = register
        self._zstd = zstd

    def add(self, key: str, raw: bytes) -> int:
        """Add a blob; zstd-compressed where that saves enough (see the class). Returns its stored size."""
        return self.add_many([(key, raw)], threads=1)[0]

    def add_many(self, items, threads: int | None = None) -> list[int]:
        """``add`` for many (key, raw) blobs in order, zstd tried in a thread pool (zstandard releases
        the GIL): the same blobs as ``add`` one by one. Returns their stored sizes."""
        items = list(items)
        keys = [k for k, _ in items]
        if len(set(keys)) < len(keys) or self._keys.intersection(keys):
            dup = next(k for i, k in enumerate(keys) if k in self._keys or k in keys[:i])
            raise ValueError(f"duplicate blob {dup}")
        import zstandard

        level, small, large, big = self._level, self._min_saving, self._large_min_saving, self._large_blob

        def pack(raw: bytes) -> tuple[bytes, str]:
            if not raw or not self._zstd:
                return raw, "raw"
            packed = zstandard.ZstdCompressor(level=level).compress(raw)
            need = large if len(raw) >= big else small
            return (packed, "zstd") if len(packed) <= (1.0 - need) * len(raw) else (raw, "raw")

        n = threads or min(8, os.cpu_count() or 1)
        if n <= 1 or len(items) < 2:
            done = [pack(raw) for _, raw in items]
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(n) as pool:
                done = list(pool.map(pack, [raw for _, raw in items]))
        for (key, raw), (data, codec) in zip(items, done):
            self._blobs.append((key, data, len(raw), codec))
            self._keys.add(key)
        return [len(data) for data, _ in done]

    def add_stored(self, items) -> list[int]:
        """Add blobs already in their stored form: (key, stored bytes, raw length, codec) in order
        (``rans``: a part with its codes entropy coded, kite.upcycle.codec.entropy). Returns their sizes."""
        items = list(items)
        keys = [k for k, *_ in items]
        if len(set(keys)) < len(keys) or self._keys.intersection(keys):
            dup = next(k for i, k in enumerate(keys) if k in self._keys or k in keys[:i])
            raise ValueError(f"duplicate blob {dup}")
        for key, data, raw_len, codec in items:
            if codec not in BLOB_CODECS or (codec == "raw" and raw_len != len(data)):
                raise ValueError(f"blob {key}: codec {codec!r} with {len(data)} stored bytes of {raw_len}")
            self._blobs.append((key, data, raw_len, codec))
            self._keys.add(key)
        return [len(d) for _, d, *_ in items]

    def write(self, path: str | os.PathLike[str], meta: dict[str, Any]) -> int:
        """Write the state to `path`; returns its size in bytes."""
        index, offset = [], 0
        for key, data, raw_len, codec in self._blobs:
            index.append(BlobEntry(key, offset, len(data), raw_len, codec, _digest(data)).to_json())
            offset += len(data)
        full = _sealed(meta, index)
        check_header(full, path)  # never write a state no reader would open
        header = json.dumps(full, separators=(",", ":"), ensure_ascii=False).encode()
        pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(header), bytes.fromhex(_digest(header)))
        with atomic_writer(path) as fh:
            fh.write(pre)
            fh.write(header)
            for _, data, _, _ in self._blobs:
                fh.write(data)
            fh.flush()
            written = os.fstat(fh.fileno())
        if self._register and records_enabled():
            # the file now at `path` is the one written here when it is the same inode, unchanged
            # since (the rename keeps mtime); its checksums were computed from these very bytes
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                fd = -1
            if fd >= 0:
                try:
                    st = os.fstat(fd)
                    if (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns) == \
                            (written.st_ino, written.st_dev, written.st_size, written.st_mtime_ns):
                        record_verified(file_version(fd, path), _digest(header), [k for k, *_ in self._blobs])
                finally:
                    os.close(fd)
        return _PREAMBLE.size + len(header) + offset


# What the estimate counts for the header's fields that name the machine, the moment or a
# measurement rather than what was asked for: each at a fixed width (JSON characters), so the same
# document, model and settings get the same budget, bit allocation and bytes on every machine
# (a model's path, a release's version, a float the tagger measured in its last digits; a
# longer value costs the state its excess bytes).
FIXED_WIDTHS = {"model.spec": 160, "source.name": 64, "kite_version": 16}
MEASURED_FLOAT_WIDTH = 24       # the tagger's accuracies and temperatures (full repr)
ROUNDED_FLOAT_WIDTH = 6         # the clusters' confidences and label probabilities (4 places)


def _width(n: int) -> str:
    return "x" * max(0, n - 2)      # a JSON string of n characters, quotes included


def _floats_at(value, width: int):
    if isinstance(value, float):
        return _width(width)
    if isinstance(value, dict):
        return {k: _floats_at(v, width) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats_at(v, width) for v in value]
    return value


def _counted(meta: dict) -> dict:
    """``meta`` as :func:`header_estimate` counts it (:data:`FIXED_WIDTHS`)."""
    out = {k: v for k, v in meta.items() if k not in ("content", "blobs", "signature")}
    for dotted, width in FIXED_WIDTHS.items():
        head, _, leaf = dotted.rpartition(".")
        if head and isinstance(out.get(head), dict) and leaf in out[head]:
            out[head] = {**out[head], leaf: _width(width)}
        elif not head and leaf in out:
            out[leaf] = _width(width)
    if "tagger" in out:
        out["tagger"] = _floats_at(out["tagger"], MEASURED_FLOAT_WIDTH)
    if "clusters" in out:
        out["clusters"] = _floats_at(out["clusters"], ROUNDED_FLOAT_WIDTH)
    return out


def header_estimate(meta: dict, keys: list[str], state_bytes: float) -> int:
    """Bytes the preamble and header of a state take: ``meta`` as :meth:`StateWriter.write` would
    seal it with blobs under ``keys`` in a file of about ``state_bytes`` (each index entry's offset
    and lengths estimated from it; the content digest's section exact; a signature not counted),
    the fields of :data:`FIXED_WIDTHS` and the measured floats at fixed widths: the estimate is a
    function of the document, the model and the settings only."""
    size = max(1, int(state_bytes))
    each = max(1, size // max(1, len(keys)))
    entries = sum(len(json.dumps([k, size, each, each, "zstd", "0" * 32], separators=(",", ":"))) + 1 for k in keys)
    body = {**_counted(meta), "content": content_digest({}, []), "blobs": []}
    return _PREAMBLE.size + len(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()) + entries


def _sealed(meta: dict, index: list) -> dict:
    """The header a writer stores: ``meta`` with its ``content`` section (:func:`.header.content_digest`)
    for the blob index ``index``, the index, and its keyed digest when a state key is configured
    (:func:`.signing.signed`; a stale one dropped)."""
    rest = {k: v for k, v in meta.items() if k not in ("content", "blobs", "signature")}
    return signed({**rest, "content": content_digest(rest, index), "blobs": index}, FORMAT_VERSION)


def check_meta(meta: dict, version: int, where, policy=None) -> int:
    """Every check of a header every reader makes, in one place: its fields against each other and
    its content digest (:func:`.header.check_header`), its content address recomputed and compared
    with the fingerprint, regenerator and format version it names (:func:`.address.check_address`),
    and its keyed digest under the signing policy (:func:`.signing.check_signature`; ``policy``
    None: the config's). BadInput (one line naming ``where``); returns the bytes its blobs take."""
    data_bytes = check_header(meta, where)
    check_address(meta, version, str(where))
    check_signature(meta, version, where, policy)
    return data_bytes


# Headers already checked in this process, by their checksum, the file's version and the signing
# policy (the same bytes pass the same check under the same key): a state opened on every request
# pays the check once. -> the bytes of its blobs.
_CHECKED: dict[tuple, int] = {}
_CHECKED_LIMIT = 1024


def _checked_header(meta: dict, header_sum: str, version: int, path) -> int:
    policy = signing_policy()
    key = (header_sum, version, policy.stamp)
    data_bytes = _CHECKED.get(key)
    if data_bytes is None:
        data_bytes = check_meta(meta, version, path, policy)
        if len(_CHECKED) >= _CHECKED_LIMIT:
            _CHECKED.clear()
        _CHECKED[key] = data_bytes
    return data_bytes


class StateFile:
    """An open `.upc` file: `meta` (the header) and `read(key)` for any blob, checksum-verified.

    Opening checks the header (:func:`check_meta`: its fields against each other, its content
    digest, its content address) and the file's size against the blob index: a file cut short or
    with bytes after its last part is refused at once, without reading any blob.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            self._fh: BinaryIO = open(self.path, "rb")
        except FileNotFoundError:
            raise BadInput(f"{self.path}: no such state file")
        except IsADirectoryError:
            raise BadInput(f"{self.path}: is a folder, not a .upc state")
        try:
            self.meta, self._data_start = self._read_header()
            self.file_size = os.fstat(self._fh.fileno()).st_size
            self._check_size(self._data_start + _checked_header(self.meta, self.header_sum, self.format_version, self.path))
        except BaseException:
            self._fh.close()
            raise
        self.index = {e.key: e for e in (BlobEntry.from_json(r) for r in self.meta.pop("blobs"))}

    def _check_size(self, expected: int) -> None:
        have = self.file_size
        if have < expected:
            raise BadInput(f"{self.path}: truncated .upc state ({have:,} bytes; its header's blob index "
                           f"says {expected:,})")
        if have > expected:
            raise BadInput(f"{self.path}: corrupt .upc state ({have:,} bytes; its header's blob index "
                           f"says {expected:,}: {have - expected:,} bytes after the last part)")

    @property
    def data_start(self) -> int:
        """File offset of the first blob (a blob lies at ``data_start + entry.offset``)."""
        return self._data_start

    @property
    def version(self) -> tuple:
        """The version of the file's bytes now (:func:`kite.upcycle.format.versions.file_version`,
        read again at every call): what every cache of a loaded state keys on."""
        return file_version(self._fh.fileno(), self.path)

    def fileno(self) -> int:
        """The open file's descriptor (for ``os.pread`` / ``os.fstat`` by a loader)."""
        return self._fh.fileno()

    def _read_header(self) -> tuple[dict, int]:
        pre = self._fh.read(_PREAMBLE.size)
        if len(pre) < 8 or pre[:8] != MAGIC:
            raise BadInput(f"{self.path}: not a .upc state (wrong magic bytes)")
        if len(pre) < _PREAMBLE.size:
            raise BadInput(f"{self.path}: truncated .upc state (the header is cut off)")
        _, version, _flags, hlen, hsum = _PREAMBLE.unpack(pre)
        if version > FORMAT_VERSION:
            raise BadInput(f"{self.path}: .upc format version {version} is newer than this KITE reads "
                           f"({FORMAT_VERSION}); upgrade KITE")
        if version < 1:
            raise BadInput(f"{self.path}: corrupt .upc state (format version {version}; versions start at 1)")
        if hlen > MAX_HEADER:
            raise BadInput(f"{self.path}: corrupt .upc state (header length {hlen})")
        header = self._fh.read(hlen)
        if len(header) < hlen:
            raise BadInput(f"{self.path}: truncated .upc state (the header is cut off)")
        if _digest(header) != hsum.hex():
            raise BadInput(f"{self.path}: corrupt .upc state (header checksum mismatch)")
        self.header_sum = hsum.hex()
        self.format_version = version
        try:
            meta = json.loads(header)
        except ValueError:
            raise BadInput(f"{self.path}: corrupt .upc state (header is not JSON)")
        return meta, _PREAMBLE.size + hlen

    def read(self, key: str, verify: bool = True) -> bytes:
        """The blob's raw (decompressed) bytes. Raises BadInput on truncation or a bad checksum."""
        entry = self.index.get(key)
        if entry is None:
            raise BadInput(f"{self.path}: no part {key!r} in this state")
        self._fh.seek(self._data_start + entry.offset)
        data = self._fh.read(entry.length)
        if len(data) < entry.length:
            raise BadInput(f"{self.path}: truncated .upc state (part {key} is cut off)")
        if verify:
            self.check_blob(key, data)
        return self.inflate(key, data) if entry.codec != "raw" else data

    def inflate(self, key: str, data: bytes) -> bytes:
        """A stored blob's raw bytes (zstd-compressed, or a part whose codes are entropy coded), never
        more than its index says (BadInput naming the part when it does not decode or comes out
        another length)."""
        import zstandard

        raw_length = self.index[key].raw_length
        if self.index[key].codec == "rans":
            from kite.upcycle.format import entropy_blob

            try:
                return entropy_blob.unpack(data, raw_length, self.entropy_tables())
            except ValueError as exc:
                raise BadInput(f"{self.path}: corrupt .upc state (part {key}: {exc})") from None
        try:
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_length)
        except zstandard.ZstdError as exc:
            raise BadInput(f"{self.path}: corrupt .upc state (part {key} does not decompress: {exc})") from None
        if len(raw) != raw_length:
            raise BadInput(f"{self.path}: corrupt .upc state (part {key} decompresses to {len(raw):,} bytes, "
                           f"its index says {raw_length:,})")
        return raw

    def entropy_tables(self) -> dict:
        """The tables of its entropy-coded parts (the header's ``entropy`` section), read once."""
        tables = getattr(self, "_entropy_tables", None)
        if tables is None:
            from kite.upcycle.format import entropy_blob

            tables = self._entropy_tables = entropy_blob.tables_from(self.meta.get("entropy"))
        return tables

    def check_blob(self, key: str, stored) -> None:
        """BadInput unless `stored` (part `key`'s bytes as stored) matches the index's checksum."""
        if _digest(stored) != self.index[key].checksum:
            raise BadInput(f"{self.path}: corrupt .upc state (checksum mismatch in part {key})")

    def verify(self) -> dict[str, str]:
        """Checksum status of every blob: 'ok' or what is wrong."""
        status = {}
        for key in self.index:
            try:
                self.read(key)
                status[key] = "ok"
            except BadInput as exc:
                status[key] = str(exc).split(": ", 1)[-1]
        return status

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "StateFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_state_bytes(data: bytes, where: str = "state") -> tuple[dict, int]:
    """The header of a whole state held in memory (a store's object), after the checks a reader
    makes of a file plus every blob's checksum: magic, version, header checksum and fields, the size
    against the blob index, each stored blob against its checksum. BadInput (one line naming
    `where`) on the first thing wrong. Returns the header (its blob index kept) and the format version."""
    view = memoryview(data)
    if len(view) < 8 or bytes(view[:8]) != MAGIC:
        raise BadInput(f"{where}: not a .upc state (wrong magic bytes)")
    if len(view) < _PREAMBLE.size:
        raise BadInput(f"{where}: truncated .upc state (the header is cut off)")
    _, version, _flags, hlen, hsum = _PREAMBLE.unpack_from(view)
    if version > FORMAT_VERSION:
        raise BadInput(f"{where}: .upc format version {version} is newer than this KITE reads ({FORMAT_VERSION})")
    if version < 1:
        raise BadInput(f"{where}: corrupt .upc state (format version {version}; versions start at 1)")
    start = _PREAMBLE.size + hlen
    if hlen > MAX_HEADER or len(view) < start:
        raise BadInput(f"{where}: truncated .upc state (the header is cut off)")
    header = bytes(view[_PREAMBLE.size:start])
    if _digest(header) != hsum.hex():
        raise BadInput(f"{where}: corrupt .upc state (header checksum mismatch)")
    try:
        meta = json.loads(header)
    except ValueError:
        raise BadInput(f"{where}: corrupt .upc state (header is not JSON)") from None
    expected = start + check_meta(meta, version, where)
    if len(view) != expected:
        what = "truncated" if len(view) < expected else "corrupt"
        raise BadInput(f"{where}: {what} .upc state ({len(view):,} bytes; its header's blob index says {expected:,})")
    for row in meta["blobs"]:
        e = BlobEntry.from_json(row)
        if _digest(view[start + e.offset:start + e.offset + e.length]) != e.checksum:
            raise BadInput(f"{where}: corrupt .upc state (checksum mismatch in part {e.key})")
    return meta, version


def rewrite_header(src: str | os.PathLike[str], dest: str | os.PathLike[str], meta: dict[str, Any]) -> int:
    """Write `src` with a new header `meta` (blobs copied unchanged) to `dest`, atomically."""
    with StateFile(src) as sf:
        index = [e.to_json() for e in sf.index.values()]
        full = _sealed(meta, index)
        check_header(full, dest)
        header = json.dumps(full, separators=(",", ":"), ensure_ascii=False).encode()
        pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(header), bytes.fromhex(_digest(header)))
        sf._fh.seek(sf._data_start)
        with atomic_writer(dest) as fh:
            fh.write(pre)
            fh.write(header)
            while chunk := sf._fh.read(1 << 20):
                fh.write(chunk)
        return len(pre) + len(header) + sum(e.length for e in sf.index.values())
