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


def decode(data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of a blob; the tensors own their bytes. ValueError on a damaged blob."""
    if data[:3] != MAGIC:
        raise ValueError("not a codec blob (bad magic)")
    (n,) = _LEN.unpack(data[3:7])
    head = json.loads(data[7:7 + n])
    off = 7 + n
    tensors = {}
    for name, dt, shape in head["t"]:
        dtype = TORCH_DTYPES[dt]
        size = math.prod(shape) * ITEMSIZE[dt]
        buf = bytearray(data[off:off + size])
        if len(buf) != size:
            raise ValueError("truncated codec blob")
        t = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        tensors[name] = t.view(dtype).reshape(shape)
        off += size
    return head["m"], tensors


def locate(buf: memoryview, off: int) -> tuple[dict, dict[str, tuple[int, str, list[int]]]]:
    """A blob at ``buf[off:]`` read in place: its meta and {tensor: (absolute offset, dtype name,
    shape)}. BadInput when it is not a codec blob."""
    if buf[off:off + 3] != MAGIC:
        raise BadInput("corrupt .upc state (a part is not a codec blob)")
    n = int.from_bytes(buf[off + 3:off + 7], "little")
    head = json.loads(buf[off + 7:off + 7 + n].tobytes())
    pos = off + 7 + n
    tensors = {}
    for name, dt, shape in head["t"]:
        tensors[name] = (pos, dt, shape)
        pos += math.prod(shape) * ITEMSIZE[dt]
    return head["m"], tensors


def numpy_at(buf: np.ndarray, spec: tuple[int, str, list[int]]) -> np.ndarray:
    """The numpy view of a tensor :func:`locate` found (dtypes numpy has)."""
    off, dt, shape = spec
    return np.frombuffer(buf, dtype=NUMPY_DTYPES[dt], count=math.prod(shape), offset=off).reshape(shape)
