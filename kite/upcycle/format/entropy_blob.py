"""The ``rans`` blob codec of the container: a part blob whose quantized codes are entropy coded.

A PCA-coded part's codes are runs of fixed-width codes, one run per bit class (format.bitlayout):
``nsym`` codes of ``bw`` bits packed LSB-first into ``nbytes`` bytes. Their values are far from
uniform (a coefficient's codes crowd the middle of its group's range), so an order-0 entropy coder
of each run (kite.upcycle.format.rans) stores them in fewer bits. The stored form keeps every other
byte of the blob as it is, so what a reader gets back is the part blob itself, byte for byte; every
reader (host decode, GPU staging, inspect, recode) goes through ``StateFile.inflate`` and sees plain
blobs.

Stored layout (little-endian):

    magic   3 bytes  b"KE1"
    offset  u32      where the codes start in the plain blob
    length  u32      their bytes there
    nruns   u8       runs, then for each in the order the codes lie:
      bw      u8       its width (1..8): its codes are nbytes * 8 // bw of them; + 128: the run
                       is stored as it is (coding would not make it smaller)
      nbytes  u32      its bytes in the plain blob
      stored  u32      its stored bytes (coded by kite.upcycle.format.rans)
    head    the plain blob's bytes before its codes (offset bytes)
    runs    each run's coded bytes (rans format SHARED_TABLE: each width's table is the state's,
            in its header's ``entropy`` section, :func:`tables_json`)
    tail    the plain blob's bytes after its codes

:func:`pack` builds it from a plain blob and its runs; :func:`unpack` gives the plain blob back, or
ValueError saying what is damaged.
"""

from __future__ import annotations

import struct

import numpy as np

from kite.upcycle.format import rans

MAGIC = b"KE1"
CODEC = "rans"          # the container's name for blobs stored this way
_HEAD = struct.Struct("<3sIIB")       # magic, offset, length, runs
_RUN = struct.Struct("<BII")          # width, plain bytes, stored bytes
VERBATIM = 128                        # a run's width flag: stored as it is


def unpack_codes(data: bytes | memoryview | np.ndarray, bw: int, nsym: int) -> np.ndarray:
    """The first ``nsym`` codes of ``bw`` bits packed LSB-first in ``data`` (uint8)."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")[:nsym * bw]
    return (bits.reshape(nsym, bw).astype(np.uint16) << np.arange(bw, dtype=np.uint16)).sum(1).astype(np.uint8)


def pack_codes(codes: np.ndarray, bw: int, nbytes: int) -> bytes:
    """``codes`` packed LSB-first at ``bw`` bits into ``nbytes`` bytes (zero bits after the last)."""
    from kite.kernels import native

    lib = native.cpu()
    if lib is not None:
        codes = np.ascontiguousarray(codes, dtype=np.uint8)
        out = np.empty(nbytes, dtype=np.uint8)
        native.check(lib.kite_pack_codes(codes.ctypes.data, codes.size, bw, out.ctypes.data, nbytes), "pack_codes")
        return out.tobytes()
    bits = ((codes[:, None].astype(np.uint16) >> np.arange(bw, dtype=np.uint16)) & 1).astype(np.uint8).reshape(-1)
    out = np.zeros(nbytes * 8, dtype=np.uint8)
    out[:bits.size] = bits
    return np.packbits(out, bitorder="little").tobytes()


def run_codes(plain: bytes, at: tuple[int, int], runs: list[tuple[int, int]]) -> list[np.ndarray] | None:
    """Each run's codes (``nbytes * 8 // bw`` of them: the bits after a run's last code read as
    codes of 0), or None where the runs do not give the codes back exactly (bits set after a run's
    last code, runs that do not fill the codes, widths outside 1..8)."""
    offset, length = at
    if (sum(n for _, n in runs) != length or offset < 0 or offset + length > len(plain)
            or not 0 < len(runs) < 256 or any(not 1 <= bw <= 8 for bw, _ in runs)):
        return None
    out, pos = [], offset
    for bw, nbytes in runs:
        piece = plain[pos:pos + nbytes]
        codes = unpack_codes(piece, bw, nbytes * 8 // bw)
        if pack_codes(codes, bw, nbytes) != piece:
            return None
        out.append(codes)
        pos += nbytes
    return out


def pack(plain: bytes, at: tuple[int, int], runs: list[tuple[int, int]], codes: list[np.ndarray] | None,
         tables: dict[int, np.ndarray]) -> bytes | None:
    """The stored form of ``plain`` whose codes lie at ``at`` = (offset, length) as ``runs`` of (bw,
    nbytes), each run coded on ``tables[bw]`` (the state's table of its width: kept by the caller,
    not in the part); ``codes``: :func:`run_codes` of them when the caller has it. None where it
    would not be smaller or :func:`run_codes` finds no codes."""
    codes = codes if codes is not None else run_codes(plain, at, runs)
    if codes is None:
        return None
    offset, length = at
    rows, coded, pos = [], [], offset
    for (bw, nbytes), c in zip(runs, codes):
        blob = rans.encode(c, bw, tables[bw])
        verbatim = len(blob) >= nbytes
        rows.append(_RUN.pack(bw | (VERBATIM if verbatim else 0), nbytes, nbytes if verbatim else len(blob)))
        coded.append(plain[pos:pos + nbytes] if verbatim else blob)
        pos += nbytes
    head = _HEAD.pack(MAGIC, offset, length, len(runs)) + b"".join(rows)
    if len(head) + len(plain) - length + sum(len(c) for c in coded) >= len(plain):
        return None
    return b"".join([head, plain[:offset], *coded, plain[offset + length:]])


def unpack(stored: bytes | memoryview, raw_length: int, tables: dict[int, np.ndarray]) -> bytes:
    """The plain blob of a stored one (``raw_length``: its length, from the container's index;
    ``tables``: the state's table of each width, :func:`tables_from`). ValueError, saying what is
    damaged, where the stored form does not give a blob of that length."""
    stored = memoryview(stored)
    if len(stored) < _HEAD.size or bytes(stored[:3]) != MAGIC:
        raise ValueError("not an entropy-coded part (bad magic)")
    _, offset, length, nruns = _HEAD.unpack(stored[:_HEAD.size])
    pos = _HEAD.size + nruns * _RUN.size
    if len(stored) < pos:
        raise ValueError("an entropy-coded part's runs are cut off")
    runs = [_RUN.unpack(stored[_HEAD.size + i * _RUN.size:_HEAD.size + (i + 1) * _RUN.size]) for i in range(nruns)]
    if any(not 1 <= bw & ~VERBATIM <= 8 or (bw & VERBATIM and n != nbytes) for bw, nbytes, n in runs):
        raise ValueError("an entropy-coded part's runs are damaged")
    if sum(r[1] for r in runs) != length or offset + length > raw_length:
        raise ValueError("an entropy-coded part's codes do not fit its blob")
    tail = raw_length - offset - length
    if len(stored) != pos + offset + sum(r[2] for r in runs) + tail:
        raise ValueError(f"an entropy-coded part is {len(stored):,} bytes, its header says otherwise")
    out = [bytes(stored[pos:pos + offset])]
    pos += offset
    for bw, nbytes, n in runs:
        if bw & VERBATIM:
            out.append(bytes(stored[pos:pos + n]))
        elif bw not in tables:
            raise ValueError(f"an entropy-coded part has {bw}-bit codes and the state no table for them")
        else:
            out.append(pack_codes(rans.decode(stored[pos:pos + n], nbytes * 8 // bw, bw, tables[bw]), bw, nbytes))
        pos += n
    out.append(bytes(stored[pos:pos + tail]))
    return b"".join(out)


def tables_json(tables: dict[int, np.ndarray]) -> dict:
    """The state header's ``entropy`` section: the coder's scale and each width's table."""
    return {"scale": rans.SCALE_BITS, "tables": {str(bw): [int(v) for v in f] for bw, f in sorted(tables.items())}}


def tables_from(meta: dict | None) -> dict[int, np.ndarray]:
    """Each width's table from a state header's ``entropy`` section; ValueError where it is not one
    :func:`tables_json` writes (a width outside 1..8, a table not of 2**bw frequencies summing to
    2**scale)."""
    sec = meta if isinstance(meta, dict) else {}
    tables = sec.get("tables")
    if sec.get("scale") != rans.SCALE_BITS or not isinstance(tables, dict):
        raise ValueError("the state's entropy tables are missing or damaged")
    out = {}
    for key, f in tables.items():
        bw = int(key) if isinstance(key, str) and key.isdigit() else 0
        if not 1 <= bw <= 8 or not isinstance(f, list) or len(f) != 1 << bw or \
                not all(type(v) is int and v >= 0 for v in f) or sum(f) != 1 << rans.SCALE_BITS:
            raise ValueError(f"the state's entropy table of {key}-bit codes is damaged")
        out[bw] = np.asarray(f, dtype=np.int64)
    return out


__all__ = ["CODEC", "pack", "pack_codes", "run_codes", "tables_from", "tables_json", "unpack", "unpack_codes"]
