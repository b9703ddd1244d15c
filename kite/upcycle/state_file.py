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

Loading one cluster of a few layers reads the header and just those blobs.
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


class StateWriter:
    """Collect blobs, then write header + blobs atomically (invariant 4)."""

    def __init__(self, zstd_level: int = 3):
        self._blobs: list[tuple[str, bytes, int, str]] = []
        self._keys: set[str] = set()
        self._level = zstd_level

    def add(self, key: str, raw: bytes) -> int:
        """Add a blob; zstd-compressed where that saves ≥ 3 %. Returns its stored size."""
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

        level = self._level

        def pack(raw: bytes) -> tuple[bytes, str]:
            packed = zstandard.ZstdCompressor(level=level).compress(raw) if raw else b""
            return (packed, "zstd") if raw and len(packed) < 0.97 * len(raw) else (raw, "raw")

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

    def write(self, path: str | os.PathLike[str], meta: dict[str, Any]) -> int:
        """Write the state to `path`; returns its size in bytes."""
        index, offset = [], 0
        for key, data, raw_len, codec in self._blobs:
            index.append(BlobEntry(key, offset, len(data), raw_len, codec, _digest(data)).to_json())
            offset += len(data)
        header = json.dumps({**meta, "blobs": index}, separators=(",", ":"), ensure_ascii=False).encode()
        pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(header), bytes.fromhex(_digest(header)))
        with atomic_writer(path) as fh:
            fh.write(pre)
            fh.write(header)
            for _, data, _, _ in self._blobs:
                fh.write(data)
        return _PREAMBLE.size + len(header) + offset


class StateFile:
    """An open `.upc` file: `meta` (the header) and `read(key)` for any blob, checksum-verified."""

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
        except BaseException:
            self._fh.close()
            raise
        self.index = {e.key: e for e in (BlobEntry.from_json(r) for r in self.meta.pop("blobs"))}
        self.file_size = os.fstat(self._fh.fileno()).st_size

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
        if hlen > MAX_HEADER:
            raise BadInput(f"{self.path}: corrupt .upc state (header length {hlen})")
        header = self._fh.read(hlen)
        if len(header) < hlen:
            raise BadInput(f"{self.path}: truncated .upc state (the header is cut off)")
        if _digest(header) != hsum.hex():
            raise BadInput(f"{self.path}: corrupt .upc state (header checksum mismatch)")
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
        if verify and _digest(data) != entry.checksum:
            raise BadInput(f"{self.path}: corrupt .upc state (checksum mismatch in part {key})")
        if entry.codec == "zstd":
            import zstandard

            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=entry.raw_length)
        return data

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


def rewrite_header(src: str | os.PathLike[str], dest: str | os.PathLike[str], meta: dict[str, Any]) -> int:
    """Write `src` with a new header `meta` (blobs copied unchanged) to `dest`, atomically."""
    with StateFile(src) as sf:
        index = [e.to_json() for e in sf.index.values()]
        header = json.dumps({**meta, "blobs": index}, separators=(",", ":"), ensure_ascii=False).encode()
        pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(header), bytes.fromhex(_digest(header)))
        sf._fh.seek(sf._data_start)
        with atomic_writer(dest) as fh:
            fh.write(pre)
            fh.write(header)
            while chunk := sf._fh.read(1 << 20):
                fh.write(chunk)
        return len(pre) + len(header) + sum(e.length for e in sf.index.values())
