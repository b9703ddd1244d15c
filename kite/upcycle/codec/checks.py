"""What a reader checks of a layer codec and of a part before decoding them: every tensor a side's
mode calls for, of its dtype and shape, derived from the layer codec's own meta and widths and the
part's token count (its cluster's, from the header), so that no decoder (the host's torch or native
dequantizer, the GPU staging's tables) is handed a length or a width its buffer does not hold.

Both take the blobs' tables, ``{name: (dtype name, shape)}`` (:func:`table_of` makes one from
tensors; the GPU staging has one from :func:`kite.upcycle.format.codec_blob.locate`), and raise
ValueError saying what is wrong; the loader names the part in the BadInput it raises.
"""

from __future__ import annotations

import math

import numpy as np

from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.format.bitlayout import MAX_WIDTH, class_layout

FLOATS = ("f32", "f16", "bf16")
_SIDE_MODES = ("pca", "rpca", "raw", "quant")


def table_of(tensors) -> dict[str, tuple[str, list[int]]]:
    """The table of a blob's tensors: {name: (dtype name, shape)}."""
    from kite.upcycle.format.codec_blob import DTYPE_NAMES

    return {n: (DTYPE_NAMES[t.dtype], list(t.shape)) for n, t in tensors.items()}


def _whole(value, what: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} is {value!r}, expected a whole number >= {least}")
    return value


def _want(table: dict, name: str, dtypes, shape: list[int]) -> None:
    if name not in table:
        raise ValueError(f"no tensor {name}")
    dt, sh = table[name]
    if dt not in dtypes:
        raise ValueError(f"tensor {name} is {dt}, expected {' or '.join(dtypes)}")
    if list(sh) != list(shape):
        raise ValueError(f"tensor {name} has shape {list(sh)}, expected {list(shape)}")


def _only(table: dict, names: set[str]) -> None:
    extra = sorted(set(table) - names)
    if extra:
        raise ValueError(f"unexpected tensor {extra[0]}")


def layer_settings(meta: dict) -> CodecSettings:
    """The layer codec's settings, checked: fields of the right types and in range."""
    raw = meta.get("settings")
    if not isinstance(raw, dict):
        raise ValueError("the layer codec has no settings")
    try:
        s = CodecSettings(**raw)
    except TypeError as exc:
        raise ValueError(f"the layer codec's settings are malformed ({exc})") from None
    for name in ("group_size", "v_group_size", "max_bits", "outliers", "sink_tokens", "part_tokens"):
        _whole(getattr(s, name), f"settings.{name}")
    if not 1 <= s.max_bits <= MAX_WIDTH:
        raise ValueError(f"settings.max_bits is {s.max_bits}, expected 1..{MAX_WIDTH}")
    if isinstance(s.k_weight, bool) or not isinstance(s.k_weight, (int, float)) or not s.k_weight > 0:
        raise ValueError(f"settings.k_weight is {s.k_weight!r}, expected a positive number")
    for name in ("joint_heads", "even_groups"):
        if not isinstance(getattr(s, name), bool):
            raise ValueError(f"settings.{name} is {getattr(s, name)!r}, expected true or false")
    for name in ("k_fmt", "v_fmt", "basis_fmt", "range_mode", "budget"):
        if not isinstance(getattr(s, name), str):
            raise ValueError(f"settings.{name} is {getattr(s, name)!r}, expected a string")
    return s


def check_layer(meta: dict, table: dict, bits: dict, H: int, d: int) -> dict[str, np.ndarray]:
    """Check a layer codec (meta, table, ``bits``: {side: its ``{side}.bits`` values} for the PCA
    sides) for a model of ``H`` KV heads of size ``d``. Returns each PCA side's stored widths, the
    columns with bits > 0 in order ({side: int64 [R]})."""
    if not isinstance(meta, dict):
        raise ValueError("the layer codec's meta is not an object")
    s = layer_settings(meta)
    if meta.get("H") != H or meta.get("d") != d:
        raise ValueError(f"the layer codec is for {meta.get('H')!r} heads of {meta.get('d')!r}, the state's "
                         f"geometry {H} of {d}")
    names: set[str] = set()
    widths = {}
    for side in ("k", "v"):
        info = meta.get(side)
        mode = info.get("mode") if isinstance(info, dict) else None
        if mode not in _SIDE_MODES:
            raise ValueError(f"side {side}'s mode is {mode!r}, expected one of {', '.join(_SIDE_MODES)}")
        if mode in ("raw", "quant"):
            continue
        B, D = (1, H * d) if s.joint_heads else (H, d)
        if info.get("blocks") != B or info.get("dim") != D:
            raise ValueError(f"side {side} has {info.get('blocks')!r} blocks of {info.get('dim')!r}, expected "
                             f"{B} of {D}")
        _want(table, f"{side}.bits", ("u8",), [B, D])
        _want(table, f"{side}.mean", FLOATS, [B, D])
        names.update({f"{side}.bits", f"{side}.mean"})
        if f"{side}.w" in table:
            _want(table, f"{side}.w", ("f16",), [B, D])
            names.add(f"{side}.w")
        b = np.asarray(bits[side], dtype=np.int64).reshape(B, D)
        if b.size and (b.min() < 0 or b.max() > s.max_bits):
            raise ValueError(f"side {side}'s bits lie outside 0..{s.max_bits}")
        cols = b[b > 0]
        R = int(cols.size)
        if mode == "pca":
            key = f"{side}.basis"
            if key in table:
                _want(table, key, FLOATS, [D, R])
                names.add(key)
            else:
                q = meta.get(key)
                fmt = q.get("fmt") if isinstance(q, dict) else None
                if fmt not in ("int8", "int7", "int6", "int5", "int4", "int3", "int2", "int1"):
                    raise ValueError(f"side {side}'s basis is missing or of format {fmt!r}")
                if q.get("shape") != [D, R] or q.get("group_size") != D or q.get("axis") != -2 \
                        or q.get("n") != D * R or q.get("padded_cols") != D:
                    raise ValueError(f"side {side}'s basis meta does not describe a [{D}, {R}] basis")
                _want(table, f"{key}.codes", ("u8",), [(D * R * int(fmt[3:]) + 7) // 8])
                _want(table, f"{key}.scale", ("f16",), [R])
                _want(table, f"{key}.min", ("f16",), [R])
                names.update({f"{key}.codes", f"{key}.scale", f"{key}.min"})
        widths[side] = cols
    _only(table, names)
    return widths


def check_part(layer_meta: dict, side: str, widths: np.ndarray | None, meta: dict, table: dict, T: int,
               H: int, d: int, outliers: np.ndarray | None = None) -> None:
    """Check one part's blob (meta, table) of ``side`` against its layer codec (``widths``: the side's
    stored widths from :func:`check_layer`; None for a raw or quant side) and its cluster's token
    count ``T``. ``outliers``: the values of its ``out.idx`` when it has one (each must be a token of it)."""
    if not isinstance(meta, dict):
        raise ValueError("the part's meta is not an object")
    s = layer_settings(layer_meta)
    if meta.get("T") != T:
        raise ValueError(f"the part holds {meta.get('T')!r} tokens, its cluster {T}")
    mode = layer_meta[side]["mode"]
    names: set[str] = set()
    if mode in ("raw", "quant"):
        _check_plain(s, mode, side, meta, table, T, H, d)
        return
    cols = np.asarray(widths, dtype=np.int64)
    own = meta.get("bits")
    if own is not None:
        if not isinstance(own, list) or len(own) != cols.size or any(
                isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= s.max_bits for w in own):
            raise ValueError(f"the part's own widths are not {cols.size} widths in 0..{s.max_bits}")
        cols = np.asarray(own, dtype=np.int64)
    nbytes = ngroups = 0
    for bw in sorted(set(cols.tolist()) - {0}):
        _, nb, ng = class_layout(T, int((cols == bw).sum()), bw, s.group_size, s.even_groups)
        nbytes, ngroups = nbytes + nb, ngroups + ng
    if nbytes:
        _want(table, "codes", ("u8",), [nbytes])
        _want(table, "scale", ("f16",), [ngroups])
        _want(table, "min", ("f16",), [ngroups])
        names.update({"codes", "scale", "min"})
    _check_outliers(table, names, T, H, d, outliers)
    _only(table, names)


def _check_outliers(table, names, T, H, d, outliers) -> None:
    if "out.idx" not in table and "out.x" not in table:
        return
    if "out.idx" not in table or "out.x" not in table:
        raise ValueError("the part has one of out.idx and out.x without the other")
    dt, sh = table["out.idx"]
    if dt not in ("i16", "i32") or len(sh) != 1:
        raise ValueError(f"tensor out.idx is {dt} {list(sh)}, expected a row of int16 or int32")
    _want(table, "out.x", ("f16",), [H, sh[0], d])
    if outliers is not None and outliers.size and (outliers.min() < 0 or outliers.max() >= T):
        raise ValueError(f"an outlier token lies outside the part's {T} tokens")
    names.update({"out.idx", "out.x"})


def _check_plain(s: CodecSettings, mode: str, side: str, meta: dict, table: dict, T: int, H: int, d: int) -> None:
    """A raw or quant side: the tensors :func:`kite.upcycle.codec.quant.quantize` gives for [H, T, d]."""
    from kite.upcycle.codec.quant import INT_FORMATS

    q = meta.get("x")
    if not isinstance(q, dict) or q.get("shape") != [H, T, d]:
        raise ValueError(f"the part's x meta does not describe [{H}, {T}, {d}]")
    fmt = q.get("fmt")
    want = f"int{int(round(s.k_bits if side == 'k' else s.v_bits))}" if mode == "quant" else \
        (s.k_fmt if side == "k" else s.v_fmt)
    if fmt != want:
        raise ValueError(f"the part's format is {fmt!r}, its layer's {want!r}")
    if fmt in ("fp32", "fp16", "bf16"):
        _want(table, "x.data", ({"fp32": "f32", "fp16": "f16", "bf16": "bf16"}[fmt],), [H, T, d])
        _only(table, {"x.data"})
        return
    if fmt != "fp8" and fmt not in INT_FORMATS:
        raise ValueError(f"the part's format is {fmt!r}")
    axis = q.get("axis")
    if axis not in (-1, -2):
        raise ValueError(f"the part's quantization axis is {axis!r}")
    cols = d if axis == -1 else T            # the length of the grouped dimension
    rows = H * (T if axis == -1 else d)
    gs = _whole(q.get("group_size"), "the part's group size", 1 if cols else 0)
    if cols and gs > cols:
        raise ValueError(f"the part's group size {gs} is larger than its {cols} grouped values")
    padded = -(-cols // gs) * gs if cols else 0
    G = rows * padded // gs if gs else 0
    if fmt == "fp8":
        _want(table, "x.data", ("f8e4m3",), [G, gs])
        _want(table, "x.scale", ("f32",), [G])
        _only(table, {"x.data", "x.scale"})
        return
    if q.get("n") != G * gs or q.get("padded_cols") != gs:
        raise ValueError("the part's quantization meta disagrees with its shape")
    _want(table, "x.codes", ("u8",), [math.ceil(G * gs * INT_FORMATS[fmt] / 8)])
    _want(table, "x.scale", ("f16",), [G])
    _want(table, "x.min", ("f16",), [G])
    _only(table, {"x.codes", "x.scale", "x.min"})


__all__ = ["check_layer", "check_part", "layer_settings", "table_of"]
