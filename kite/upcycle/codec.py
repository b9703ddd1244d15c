"""The KV-cache codec of a `.upc` state: PCA + per-component bit allocation (KVTC-style).

Setting.  Per layer, keys are stored *pre-RoPE* (see :mod:`kite.upcycle.rope`) and values as
they are, shaped ``[H_kv, T, d]``.  The state is split into clusters (sets of token spans) that
must load independently, so the stored form is

* one **shared part per layer** (:class:`LayerCodec`, from :func:`fit_layer` on the whole
  document): the mean and PCA basis of the pre-RoPE keys and of the values -- per (layer, head),
  or over the concatenated heads of the layer (``joint_heads``, the default of ``ratio=R``) -- and
  the number of bits given to every principal component (0 = dropped; only the columns of the
  basis that get bits are stored, int8/int6 with a scale per column);
* one **part per (cluster, layer, K|V)** (:class:`Blob`, two per :class:`EncodedPart` from
  :func:`encode`): the tokens' PCA coefficients, each component quantized with its own bit width
  in groups of ``group_size`` tokens (fp16 scale and minimum per group and component, the grid
  picked by least squared error), plus the attention sink (position < ``sink_tokens``, when
  ``encode`` is given positions) and optionally a few outlier tokens kept in fp16 with their
  indices.  Keeping the sink exact is what makes low bit widths work: its value is near zero and
  takes most of the attention, so any error on it is multiplied.

Bit allocation is greedy reverse water-filling on the eigenvalues: every next bit goes to the
component where it removes the most expected squared error per stored bit (the first bit of a
component also pays for its basis column and its scales), until the layer's budget of
``k_bits`` / ``v_bits`` bits per original element is spent.  High-variance components get many
bits, the tail gets none.  The budget counts every stored byte, so ``ratio=R`` lands at about
``16 / R`` bits per element, i.e. ``1/R`` of the raw fp16 KV.  The codec is pure torch; on a
busy CPU run it with one intra-op thread (its ops are small).

Other modes (``k_mode`` / ``v_mode``): ``"quant"`` -- KIVI-style plain int-N (keys per channel,
values per token, groups of ``group_size``), ``"raw"`` -- a float cast (``fp32`` is exact).

Settings by name (:func:`settings_for`): ``"exact"`` (fp32, bit-exact), ``"fp16"``, ``"bf16"``,
``"fp8"``, ``"int8"``, ``"int4"`` (plain quantization of K and V), and ``"ratio=R"`` / ``R`` for the
PCA codec at compression ratio R against raw fp16 KV (defaults chosen by
``benchmarks/codec_sweep.py``; see docs/compression.md).

Byte accounting: :func:`nbytes` of a blob / layer codec is the length of :func:`to_bytes` -- a
little JSON header (meta + tensor table) followed by the raw tensor bytes, exactly what is stored.
"""

from __future__ import annotations

import heapq
import json
import math
import struct
from dataclasses import asdict, dataclass, field, replace

import torch

from kite.kernels.eigh import batched_pca as kernel_pca
from kite.upcycle.quant import (FLOAT_FORMATS, INT_FORMATS, QTensor, dequantize, quantize,
                                tensors_nbytes)

__all__ = [
    "CodecSettings", "LayerCodec", "Blob", "EncodedPart", "settings_for", "fit_layer", "fit_layers",
    "encode", "decode", "nbytes", "to_bytes", "from_bytes", "batched_pca", "PRESETS",
]

_MAGIC = b"KC1"


# --------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class CodecSettings:
    """Concrete codec parameters (every field is stored in the layer meta)."""

    name: str = "custom"
    k_mode: str = "pca"          # "pca" | "quant" | "raw"
    v_mode: str = "pca"
    k_bits: float = 4.0          # pca: budget in bits per original element (all bytes counted)
    v_bits: float = 4.0          # quant: the integer width (int2..int8)
    k_fmt: str = "fp16"          # raw mode: the float format of keys / values
    v_fmt: str = "fp16"
    group_size: int = 128        # tokens per quantization group (pca coefficients, quant keys)
    v_group_size: int = 64       # channels per group for values in quant mode (per token)
    basis_fmt: str = "int8"      # stored PCA basis: fp32 | fp16 | bf16 | int8 (per-column scale)
    max_bits: int = 8            # per component
    outliers: int = 0            # per part: tokens with the largest normalized energy kept in fp16
    sink_tokens: int = 1         # tokens at positions < sink_tokens kept in fp16 (attention sinks)
    part_tokens: int = 256       # expected tokens per encoded part (budgets its fixed costs)
    joint_heads: bool = False    # one PCA over the concatenated heads of a layer (H*d dims)
    center: bool = True          # subtract the per-head mean before PCA
    range_mode: str = "mse"      # pca coefficients: "mse" (clipped, Gaussian-optimal) | "minmax"

    def to_json(self) -> dict:
        return asdict(self)


def _pca(k_bits: float, v_bits: float, name: str, **kw) -> CodecSettings:
    return CodecSettings(name=name, k_mode="pca", v_mode="pca", k_bits=k_bits, v_bits=v_bits, **kw)


PRESETS: dict[str, CodecSettings] = {
    "exact": CodecSettings(name="exact", k_mode="raw", v_mode="raw", k_fmt="fp32", v_fmt="fp32"),
    "fp32": CodecSettings(name="fp32", k_mode="raw", v_mode="raw", k_fmt="fp32", v_fmt="fp32"),
    "fp16": CodecSettings(name="fp16", k_mode="raw", v_mode="raw", k_fmt="fp16", v_fmt="fp16"),
    "bf16": CodecSettings(name="bf16", k_mode="raw", v_mode="raw", k_fmt="bf16", v_fmt="bf16"),
    "fp8": CodecSettings(name="fp8", k_mode="raw", v_mode="raw", k_fmt="fp8", v_fmt="fp8"),
    "int8": CodecSettings(name="int8", k_mode="quant", v_mode="quant", k_bits=8, v_bits=8,
                          group_size=64, v_group_size=64),
    "int4": CodecSettings(name="int4", k_mode="quant", v_mode="quant", k_bits=4, v_bits=4,
                          group_size=32, v_group_size=32),
    "int3": CodecSettings(name="int3", k_mode="quant", v_mode="quant", k_bits=3, v_bits=3,
                          group_size=32, v_group_size=32),
    "int2": CodecSettings(name="int2", k_mode="quant", v_mode="quant", k_bits=2, v_bits=2,
                          group_size=32, v_group_size=32),
}

# ratio R -> the PCA codec's bits per element, all bytes counted (16 = raw fp16): k_bits + v_bits
# = 32 / R * RATIO_FILL (a margin: short parts cost more headers than budgeted), of which keys get
# the share below (values are the more sensitive side).  Chosen by benchmarks/codec_sweep.py
# (docs/compression.md); shares between tabled ratios interpolate in log-ratio. The 8× share and
# the 512-token groups were re-tuned through the whole pipeline (8 tagged clusters, `kite upcycle
# eval` on GPL-3 2,048/512): 8× share 0.3125 / groups 256 gave ΔPPL +0.52, share 0.25 +0.46,
# groups 512 +0.45, both +0.44; 4× with groups 512: -0.05 (docs/PERFORMANCE.md).
RATIO_FILL = 0.99
RATIO_K_SHARE: dict[float, float] = {2.0: 0.375, 4.0: 0.375, 8.0: 0.25, 16.0: 0.3, 32.0: 0.3}
RATIO_DEFAULTS = dict(group_size=512, outliers=0, joint_heads=True, basis_fmt="int6", sink_tokens=1)


def _ratio_bits(ratio: float) -> tuple[float, float]:
    total = 32.0 / ratio * RATIO_FILL
    pts = sorted(RATIO_K_SHARE)
    r = min(max(ratio, pts[0]), pts[-1])
    lo = max(p for p in pts if p <= r)
    hi = min(p for p in pts if p >= r)
    if hi == lo:
        share = RATIO_K_SHARE[lo]
    else:
        w = (math.log(r) - math.log(lo)) / (math.log(hi) - math.log(lo))
        share = RATIO_K_SHARE[lo] * (1 - w) + RATIO_K_SHARE[hi] * w
    return total * share, total * (1 - share)


def settings_for(spec: str | float | int | CodecSettings | None = None, **overrides) -> CodecSettings:
    """Settings from a name: a preset (``exact``, ``fp16``, ``int4`` ...), ``ratio=R`` or a number R.

    Keyword overrides replace fields (``settings_for("ratio=8", outliers=4)``).
    """
    if isinstance(spec, CodecSettings):
        s = spec
    elif spec is None:
        s = settings_for(4.0)
    elif isinstance(spec, (int, float)):
        ratio = float(spec)
        if ratio < 1:
            raise ValueError(f"compression ratio must be >= 1, got {spec}")
        if ratio <= 1.0:
            s = PRESETS["fp16"]
        else:
            kb, vb = _ratio_bits(ratio)
            # a finer basis pays at low ratios, where the coefficients are precise (measured)
            basis = "fp16" if ratio <= 2.5 else ("int8" if ratio <= 5 else "int6")
            s = _pca(kb, vb, name=f"ratio={ratio:g}", **{**RATIO_DEFAULTS, "basis_fmt": basis})
    else:
        text = str(spec).strip().lower()
        if text in PRESETS:
            s = PRESETS[text]
        else:
            t = text[6:] if text.startswith("ratio=") else text.rstrip("x")
            try:
                ratio = float(t)
            except ValueError:
                raise ValueError(f"unknown codec setting {spec!r}: use a ratio (e.g. ratio=8) or one of "
                                 + ", ".join(PRESETS)) from None
            s = settings_for(ratio)
    return replace(s, **overrides) if overrides else s


# --------------------------------------------------------------------------------------------
# containers and serialization


@dataclass
class Blob:
    """A stored unit: tensors of compact dtypes + a JSON-able meta."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


@dataclass
class LayerCodec(Blob):
    """The shared per-layer part (means, bases, bit allocations)."""

    @property
    def settings(self) -> CodecSettings:
        return CodecSettings(**self.meta["settings"])


@dataclass
class EncodedPart:
    """One (cluster, layer) part: the keys' blob and the values' blob, stored separately."""

    k: Blob
    v: Blob


_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.float8_e4m3fn: "f8e4m3", torch.uint8: "u8", torch.int16: "i16",
                torch.int32: "i32", torch.int64: "i64"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


def _header(blob: Blob) -> bytes:
    table = [[name, _DTYPE_NAMES[t.dtype], list(t.shape)] for name, t in blob.tensors.items()]
    return json.dumps({"m": blob.meta, "t": table}, separators=(",", ":")).encode()


def to_bytes(blob: Blob) -> bytes:
    """Serialize: magic, u32 header length, JSON header (meta + tensor table), tensor bytes."""
    head = _header(blob)
    parts = [_MAGIC, struct.pack("<I", len(head)), head]
    for t in blob.tensors.values():
        t = t.contiguous().cpu()
        parts.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return b"".join(parts)


def from_bytes(data: bytes, cls=Blob) -> Blob:
    if data[:3] != _MAGIC:
        raise ValueError("not a codec blob (bad magic)")
    (n,) = struct.unpack("<I", data[3:7])
    head = json.loads(data[7:7 + n])
    off = 7 + n
    tensors = {}
    for name, dt, shape in head["t"]:
        dtype = _DTYPES[dt]
        count = math.prod(shape)
        size = count * torch.empty((), dtype=dtype).element_size()
        buf = bytearray(data[off:off + size])
        if len(buf) != size:
            raise ValueError("truncated codec blob")
        t = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        tensors[name] = t.view(dtype).reshape(shape)
        off += size
    return cls(tensors=tensors, meta=head["m"])


def nbytes(obj) -> int:
    """Every stored byte of a blob, layer codec, part, or an iterable of them."""
    if isinstance(obj, EncodedPart):
        return nbytes(obj.k) + nbytes(obj.v)
    if isinstance(obj, Blob):
        return 3 + 4 + len(_header(obj)) + tensors_nbytes(obj.tensors)
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    return sum(nbytes(o) for o in obj)


# --------------------------------------------------------------------------------------------
# PCA and bit allocation


def batched_pca(X: torch.Tensor, center: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PCA of many small matrices at once: X [B, T, d] -> mean [B, d], eigvals [B, d] (desc), U [B, d, d].

    Batched fp64 Gram + one batched symmetric eigensolver (kite.kernels: native Householder/QL
    per matrix when the runtime is built, ``torch.linalg.eigh`` otherwise) instead of a
    per-matrix SVD.  Eigenvalues are per-token variances (Gram / T).
    """
    return kernel_pca(X, center)


# expected squared error of a b-bit min/max uniform quantizer on ~Gaussian data, relative to the
# variance (b = 0: the component is dropped).  Range of a group of ~128 samples is ~5.2 sigma.
_GAUSS_D = {0: 1.0, 1: 0.3634, 2: 0.1188, 3: 0.03744, 4: 0.01154, 5: 0.00349, 6: 0.00105,
            7: 0.000307, 8: 0.0000881}


def _rel_distortion(b: int, range_mode: str = "mse") -> float:
    if b <= 0:
        return 1.0
    if range_mode == "mse":
        return _GAUSS_D[min(b, 8)]
    return min(1.0, (5.2 ** 2 / 12.0) * 4.0 ** (-b))


def first_bit_cost(T: int, d_in: int, s: CodecSettings) -> float:
    """Bits the first bit of a component costs: its T codes, a scale and minimum (fp16) per group
    of every expected part, and its basis column of `d_in` entries (with a scale when int)."""
    n_parts = max(1, math.ceil(T / max(1, s.part_tokens)))
    per_part = min(T, s.part_tokens)
    gs = s.group_size if 0 < s.group_size < per_part else per_part
    groups = n_parts * math.ceil(per_part / max(1, gs))
    if s.basis_fmt in INT_FORMATS:
        basis_bits = INT_FORMATS[s.basis_fmt] + 32 / d_in
    else:
        basis_bits = {"fp32": 32, "fp16": 16, "bf16": 16}[s.basis_fmt]
    return T + groups * 32 + d_in * basis_bits


def allocate_bits(evals: torch.Tensor, budget_bits: float, T: int, d_in: int, s: CodecSettings) -> torch.Tensor:
    """Greedy bit allocation over components of several blocks.

    evals [B, r] (variances, per block sorted desc); ``budget_bits``: bits available for the
    whole layer tensor (coefficients + scales + basis columns).  Returns int bits [B, r].
    """
    B, r = evals.shape
    first_cost = first_bit_cost(T, d_in, s)
    bits = torch.zeros(B, r, dtype=torch.int64)
    ev = evals.double().tolist()
    heap = []
    for b in range(B):
        for j in range(r):
            lam = ev[b][j]
            if lam <= 0:
                continue
            gain = lam * (1.0 - _rel_distortion(1, s.range_mode)) * T
            heapq.heappush(heap, (-gain / first_cost, b, j, first_cost))
    spent = 0.0
    while heap:
        neg, b, j, cost = heapq.heappop(heap)
        if spent + cost > budget_bits:
            continue  # a cheaper increment elsewhere may still fit
        spent += cost
        cur = int(bits[b, j]) + 1
        bits[b, j] = cur
        if cur < s.max_bits:
            lam = ev[b][j]
            gain = lam * (_rel_distortion(cur, s.range_mode) - _rel_distortion(cur + 1, s.range_mode)) * T
            heapq.heappush(heap, (-gain / T, b, j, T))
    return bits


# --------------------------------------------------------------------------------------------
# fit / encode / decode


def _blocks(X: torch.Tensor, joint: bool) -> torch.Tensor:
    """[H, T, d] -> [B, T, D]: per head (B=H, D=d) or joint (B=1, D=H*d)."""
    if joint:
        H, T, d = X.shape
        return X.permute(1, 0, 2).reshape(1, T, H * d)
    return X


def _unblocks(Y: torch.Tensor, joint: bool, H: int, d: int) -> torch.Tensor:
    if joint:
        T = Y.shape[1]
        return Y.reshape(T, H, d).permute(1, 0, 2)
    return Y


def _store_float(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return t.to(FLOAT_FORMATS[fmt] if fmt != "fp8" else torch.float16).contiguous()


def _fit_pca_side(prefix: str, X: torch.Tensor, bits_per_elem: float, s: CodecSettings,
                  tensors: dict, meta: dict, pca=None, budget_tokens: int | None = None) -> None:
    H, T, d = X.shape
    T = budget_tokens or T  # the tokens the shared part's bytes are spread over
    Xb = _blocks(X.float(), s.joint_heads)
    mean, evals, U = pca if pca is not None else batched_pca(Xb, center=s.center)
    B, D = evals.shape
    # fixed costs: the mean, the layer header's share, and per expected part (``part_tokens``) a
    # blob header (~160 B) and the fp16 sinks of the first part
    n_parts = max(1, math.ceil(T / max(1, s.part_tokens)))
    budget = (bits_per_elem * H * T * d - B * D * (16 + 8) - 8 * 450 - n_parts * 8 * 160
              - s.sink_tokens * H * d * 16)
    bits = allocate_bits(evals, budget, T, D, s)
    r = int((bits > 0).sum(dim=1).max().item()) if bits.numel() else 0
    # components with bits are a prefix per block (greedy on desc eigvals mostly is); store the
    # columns that get bits, in order, and the bit vector per block
    tensors[f"{prefix}.mean"] = _store_float(mean, "fp32" if s.basis_fmt == "fp32" else "fp16")
    cols = []
    for b in range(B):
        idx = torch.nonzero(bits[b] > 0).flatten()
        cols.append(U[b][:, idx])
    basis = torch.cat(cols, dim=1) if cols else torch.zeros(D, 0)
    if s.basis_fmt.startswith("int"):
        q = quantize(basis, s.basis_fmt, group_size=D, axis=-2)   # one scale per column
        _qblob_put(tensors, f"{prefix}.basis", q, meta, f"{prefix}.basis")
    else:
        tensors[f"{prefix}.basis"] = _store_float(basis, s.basis_fmt)
    tensors[f"{prefix}.bits"] = bits.to(torch.uint8).contiguous()
    meta[prefix] = {"mode": "pca", "blocks": B, "dim": D, "rank_max": r}


def fit_layer(K_pre: torch.Tensor, V: torch.Tensor, settings: CodecSettings | str | float | None = None,
              pca: dict | None = None, budget_tokens: int | None = None) -> LayerCodec:
    """Fit the shared per-layer part on the whole document's pre-RoPE keys and values [H, T, d].

    ``pca`` may carry precomputed ``{"k": (mean, evals, U), "v": (...)}`` from :func:`fit_layers`'
    batched path. ``budget_tokens`` (default: the T fitted on) is how many tokens the bit budget
    is spread over: the shared part is paid once for that many tokens, so a codec fitted on a
    sample and used for more tokens (the budgeted KV cache) gives its parts the bits they carry.
    """
    s = settings_for(settings)
    if K_pre.dim() != 3 or K_pre.shape != V.shape:
        raise ValueError(f"keys and values must both be [H, T, d], got {tuple(K_pre.shape)} and "
                         f"{tuple(V.shape)}")
    H, T, d = K_pre.shape
    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {"settings": s.to_json(), "H": H, "d": d, "T_fit": T}
    for side, X, mode, bpe in (("k", K_pre, s.k_mode, s.k_bits), ("v", V, s.v_mode, s.v_bits)):
        if mode == "pca":
            _fit_pca_side(side, X, bpe, s, tensors, meta, pca=(pca or {}).get(side),
                          budget_tokens=budget_tokens)
        elif mode in ("quant", "raw"):
            meta[side] = {"mode": mode}
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return LayerCodec(tensors=tensors, meta=meta)


def fit_layers(KV: list[tuple[torch.Tensor, torch.Tensor]], settings=None) -> list[LayerCodec]:
    """Fit every layer, with all PCAs of the model in one batched Gram + eigh per side."""
    s = settings_for(settings)
    pcas: list[dict] = [dict() for _ in KV]
    for side, mode in (("k", s.k_mode), ("v", s.v_mode)):
        if mode != "pca":
            continue
        Xs = [_blocks((k if side == "k" else v).float(), s.joint_heads) for k, v in KV]
        same = len({tuple(x.shape) for x in Xs}) == 1
        if same:
            mean, ev, U = batched_pca(torch.cat(Xs, dim=0), center=s.center)
            B = Xs[0].shape[0]
            for i in range(len(KV)):
                pcas[i][side] = (mean[i * B:(i + 1) * B], ev[i * B:(i + 1) * B], U[i * B:(i + 1) * B])
    return [fit_layer(k, v, s, pca=p) for (k, v), p in zip(KV, pcas)]


def _qblob_put(tensors: dict, prefix: str, q: QTensor, qmeta: dict, key: str) -> None:
    for name, t in q.tensors.items():
        tensors[f"{prefix}.{name}"] = t
    qmeta[key] = q.meta


def _qblob_get(tensors: dict, prefix: str, qmeta: dict, key: str) -> QTensor:
    p = prefix + "."
    return QTensor({n[len(p):]: t for n, t in tensors.items() if n.startswith(p)}, qmeta[key])


def _basis(lc: LayerCodec, side: str) -> torch.Tensor:
    key = f"{side}.basis"
    if key in lc.tensors:
        return lc.tensors[key].float()
    cache = lc.__dict__.setdefault("_cache", {})
    if key not in cache:
        cache[key] = dequantize(_qblob_get(lc.tensors, key, lc.meta, key), torch.float32)
    return cache[key]


def _encode_side(lc: LayerCodec, side: str, X: torch.Tensor, positions: torch.Tensor | None = None) -> Blob:
    s = lc.settings
    info = lc.meta[side]
    mode = info["mode"]
    H, T, d = X.shape
    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {"T": T}
    if mode == "raw":
        fmt = s.k_fmt if side == "k" else s.v_fmt
        q = quantize(X, fmt, group_size=0 if fmt != "fp8" else d, axis=-1)
        _qblob_put(tensors, "x", q, meta, "x")
        return Blob(tensors, meta)
    if mode == "quant":
        bits = int(round(s.k_bits if side == "k" else s.v_bits))
        if side == "k":  # KIVI: keys per channel (groups along tokens)
            q = quantize(X.float(), f"int{bits}", group_size=s.group_size, axis=-2)
        else:            # values per token (groups along channels)
            q = quantize(X.float(), f"int{bits}", group_size=s.v_group_size, axis=-1)
        _qblob_put(tensors, "x", q, meta, "x")
        return Blob(tensors, meta)
    # pca
    Xb = _blocks(X.float(), s.joint_heads)              # [B, T, D]
    mean = lc.tensors[f"{side}.mean"].float()           # [B, D]
    basis = _basis(lc, side)                            # [D, sum r_b]
    bits = lc.tensors[f"{side}.bits"].long()            # [B, D]
    B = Xb.shape[0]
    Xc = Xb - mean[:, None, :]
    coefs = []
    off = 0
    for b in range(B):
        r = int((bits[b] > 0).sum())
        coefs.append(Xc[b] @ basis[:, off:off + r])      # [T, r]
        off += r
    C = torch.cat(coefs, dim=1) if coefs else Xc.new_zeros(T, 0)   # [T, R]
    colbits = torch.cat([bits[b][bits[b] > 0] for b in range(B)]) if B else bits.new_zeros(0)
    forced = (torch.nonzero(positions < s.sink_tokens).flatten() if positions is not None and s.sink_tokens > 0
              else torch.zeros(0, dtype=torch.long))
    if (s.outliers > 0 or forced.numel()) and T > 0 and C.shape[1] > 0:
        # sinks, then the tokens whose coefficients are most extreme relative to their column's spread
        z = (C / C.std(dim=0, keepdim=True).clamp_min(1e-12)).abs().amax(dim=1)
        z[forced] = float("inf")
        n_out = min(s.outliers + forced.numel(), T)
        idx = torch.topk(z, n_out).indices.sort().values
        raw = X.float()[:, idx, :]                                    # [H, n, d]
        tensors["out.idx"] = idx.to(torch.int32 if T > 32767 else torch.int16)
        tensors["out.x"] = raw.to(torch.float16).contiguous()
        C = C.clone()
        keep = torch.ones(T, dtype=torch.bool)
        keep[idx] = False
        if keep.any():
            C[idx] = C[keep].mean(dim=0)  # neutral value: does not widen any group's range
    # one codes / scale / min tensor for all bit classes: the layout follows from the layer's bits
    codes, scales, mins = [], [], []
    for bw in sorted(set(colbits.tolist())):
        sel = torch.nonzero(colbits == bw).flatten()
        q = quantize(C[:, sel], f"int{bw}", group_size=s.group_size, axis=-2, range_mode=s.range_mode)
        codes.append(q.tensors["codes"])
        scales.append(q.tensors["scale"])
        mins.append(q.tensors["min"])
    if codes:
        tensors["codes"] = torch.cat(codes)
        tensors["scale"] = torch.cat(scales)
        tensors["min"] = torch.cat(mins)
    return Blob(tensors, meta)


def _class_layout(T: int, ncols: int, bw: int, group_size: int) -> tuple[dict, int, int]:
    """The QTensor meta, code bytes and group count of one bit class of a part (as quantize made it)."""
    gs = T if group_size <= 0 or group_size >= T else group_size
    padded = -(-T // gs) * gs if T else 0
    n = ncols * padded
    groups = n // gs if gs else 0
    meta = {"fmt": f"int{bw}", "shape": [T, ncols], "group_size": gs, "axis": -2, "n": n,
            "padded_cols": gs}
    return meta, (n * bw + 7) // 8, groups


def _decode_side(lc: LayerCodec, side: str, blob: Blob) -> torch.Tensor:
    s = lc.settings
    mode = lc.meta[side]["mode"]
    H, d = lc.meta["H"], lc.meta["d"]
    T = blob.meta["T"]
    if mode in ("raw", "quant"):
        return dequantize(_qblob_get(blob.tensors, "x", blob.meta, "x"), torch.float32)
    mean = lc.tensors[f"{side}.mean"].float()
    basis = _basis(lc, side)
    bits = lc.tensors[f"{side}.bits"].long()
    B, D = bits.shape
    colbits = torch.cat([bits[b][bits[b] > 0] for b in range(B)])
    C = torch.zeros(T, colbits.numel())
    co = go = 0
    for bw in sorted(set(colbits.tolist())):
        sel = torch.nonzero(colbits == bw).flatten()
        qmeta, nb, ng = _class_layout(T, sel.numel(), bw, s.group_size)
        q = QTensor({"codes": blob.tensors["codes"][co:co + nb], "scale": blob.tensors["scale"][go:go + ng],
                     "min": blob.tensors["min"][go:go + ng]}, qmeta)
        co, go = co + nb, go + ng
        C[:, sel] = dequantize(q, torch.float32)
    Y = torch.empty(B, T, D)
    off = 0
    for b in range(B):
        r = int((bits[b] > 0).sum())
        Y[b] = C[:, off:off + r] @ basis[:, off:off + r].T + mean[b]
        off += r
    X = _unblocks(Y, s.joint_heads, H, d)
    if "out.idx" in blob.tensors:
        idx = blob.tensors["out.idx"].long()
        X = X.clone()
        X[:, idx, :] = blob.tensors["out.x"].float()
    return X


def encode(layer_codec: LayerCodec, K_pre_sub: torch.Tensor, V_sub: torch.Tensor,
           positions=None) -> EncodedPart:
    """Encode one part (a cluster's tokens of one layer): pre-RoPE keys and values [H, T_sub, d].

    ``positions`` (1-D, the tokens' positions in the document) lets the codec keep the attention
    sinks (positions < ``sink_tokens``) in fp16; without it no token is treated as a sink.
    """
    if positions is not None:
        positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        if positions.numel() != K_pre_sub.shape[1]:
            raise ValueError(f"{positions.numel()} positions for {K_pre_sub.shape[1]} tokens")
    H, d = layer_codec.meta["H"], layer_codec.meta["d"]
    for name, X in (("keys", K_pre_sub), ("values", V_sub)):
        if X.dim() != 3 or X.shape[0] != H or X.shape[2] != d:
            raise ValueError(f"{name} must be [{H}, T, {d}], got {tuple(X.shape)}")
    return EncodedPart(k=_encode_side(layer_codec, "k", K_pre_sub, positions),
                       v=_encode_side(layer_codec, "v", V_sub, positions))


def decode(layer_codec: LayerCodec, part: EncodedPart) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a part to float32 (pre-RoPE keys, values), each [H, T_sub, d]."""
    return _decode_side(layer_codec, "k", part.k), _decode_side(layer_codec, "v", part.v)
