"""The byte format of a codec blob: every shared layer codec and every part of a `.upc` state.

    magic   3 bytes  b"KC1"
    hlen    u32      little-endian length of the JSON header
    header  hlen bytes of compact JSON: {"m": meta, "t": [[name, dtype, shape], ...]}
    data    the tensors' bytes in table order, row-major, no padding

Dtype names: f32, f16, bf16, f8e4m3, u8, i16, i32, i64 (little-endian). Writers and readers of
this format (the per-layer codec, the batched encoder, the GPU staging parser) all go through this
module; docs/upc-format.md describes it for other implementations.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import torch

from kite.errors import BadInput

MAGIC = b"KC1"
_LEN = struct.Struct("<I")
PREFIX_BYTES = len(MAGIC) + _LEN.size

DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
               torch.float8_e4m3fn: "f8e4m3", torch.uint8: "u8", torch.int16: "i16",
               torch.int32: "i32", torch.int64: "i64"}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
ITEMSIZE = {name: dt.itemsize for dt, name in DTYPE_NAMES.items()}
# numpy views of the names numpy has (bf16 and fp8 are read as raw bytes)
NUMPY_DTYPES = {"f32": np.float32, "f16": np.float16, "u8": np.uint8, "i16": np.int16, "i32": np.int32,
                "i64": np.int64}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def header_bytes(meta: dict, table) -> bytes:
    """The JSON header for ``meta`` and a table of (name, dtype name, shape) rows."""
    return json.dumps({"m": meta, "t": [[n, dt, list(sh)] for n, dt, sh in table]},
                      separators=(",", ":")).encode()


def blob_nbytes(meta: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Bytes :func:`encode` gives for these tensors and meta, without serializing the tensors."""
    head = header_bytes(meta, [(n, DTYPE_NAMES[t.dtype], t.shape) for n, t in tensors.items()])
    return PREFIX_BYTES + len(head) + sum(t.numel() * t.element_size() for t in tensors.values())


def encode(meta: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """A blob of torch tensors (any device; copied to the host)."""
    rows = []
    for name, t in tensors.items():
        t = t.contiguous().cpu()
        rows.append((name, DTYPE_NAMES[t.dtype], list(t.shape),
                     t.view(torch.uint8).numpy().tobytes() if t.numel() else b""))
    return encode_rows(meta, rows)


def encode_rows(meta: dict, rows) -> bytes:
    """A blob given as (name, dtype name, shape, data) rows; data is bytes-like or a list of
    bytes-like pieces whose concatenation is the tensor's bytes (the batched encoder's slices)."""
    head = header_bytes(meta, [(n, dt, sh) for n, dt, sh, _ in rows])
    bufs = [MAGIC, _LEN.pack(len(head)), head]
    for *_, data in rows:
        if isinstance(data, list):
            bufs += data
        else:
            bufs.append(data)
    return b"".join(bufs)


def read_table(data, off: int = 0) -> tuple[dict, list[tuple[str, str, list[int], int]], int]:
    """The blob at ``data[off:]``: its meta and its table as (name, dtype name, shape, absolute offset)
    rows, and where its bytes end. ValueError, saying what is wrong, unless the header is JSON of the
    documented form and the tensors' bytes fill the blob exactly (no tensor past its end, no byte
    after the last)."""
    end = len(data)
    if bytes(data[off:off + 3]) != MAGIC:
        raise ValueError("not a codec blob (bad magic)")
    if end - off < PREFIX_BYTES:
        raise ValueError("truncated codec blob (its header is cut off)")
    (n,) = _LEN.unpack(bytes(data[off + 3:off + 7]))
    if n > end - off - PREFIX_BYTES:
        raise ValueError("truncated codec blob (its header is cut off)")
    try:
        head = json.loads(bytes(data[off + 7:off + 7 + n]))
    except ValueError:
        raise ValueError("a codec blob's header is not JSON") from None
    if not isinstance(head, dict) or not isinstance(head.get("m"), dict) or not isinstance(head.get("t"), list):
        raise ValueError("a codec blob's header is not {m, t}")
    pos = off + 7 + n
    rows, names = [], set()
    for row in head["t"]:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and row[1] in ITEMSIZE
                and isinstance(row[2], list) and all(type(x) is int and x >= 0 for x in row[2])):
            raise ValueError(f"a codec blob's tensor row {str(row)[:60]} is not [name, dtype, shape]")
        if row[0] in names:
            raise ValueError(f"tensor {row[0]} appears twice in a codec blob")
        names.add(row[0])
        size = math.prod(row[2]) * ITEMSIZE[row[1]]
        if size > end - pos:
            raise ValueError(f"truncated codec blob (tensor {row[0]} is cut off)")
        rows.append((row[0], row[1], row[2], pos))
        pos += size
    if pos != end:
        raise ValueError(f"corrupt codec blob ({end - pos} bytes after its last tensor)")
    return head["m"], rows, pos


def decode(data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of a blob; the tensors own their bytes. ValueError on a damaged blob."""
    meta, rows, _ = read_table(data)
    tensors = {}
    for name, dt, shape, off in rows:
        size = math.prod(shape) * ITEMSIZE[dt]
        buf = bytearray(data[off:off + size])
        t = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        tensors[name] = t.view(TORCH_DTYPES[dt]).reshape(shape)
    return meta, tensors


def locate(buf: memoryview, off: int, end: int) -> tuple[dict, dict[str, tuple[int, str, list[int]]]]:
    """A blob at ``buf[off:end]`` read in place: its meta and {tensor: (absolute offset, dtype name,
    shape)}. BadInput when it is not a whole codec blob."""
    try:
        meta, rows, _ = read_table(buf[:end], off)
    except ValueError as exc:
        raise BadInput(f"corrupt .upc state ({exc})") from None
    return meta, {name: (pos, dt, shape) for name, dt, shape, pos in rows}


def numpy_at(buf: np.ndarray, spec: tuple[int, str, list[int]]) -> np.ndarray:
    """The numpy view of a tensor :func:`locate` found (dtypes numpy has)."""
    off, dt, shape = spec
    return np.frombuffer(buf, dtype=NUMPY_DTYPES[dt], count=math.prod(shape), offset=off).reshape(shape)
