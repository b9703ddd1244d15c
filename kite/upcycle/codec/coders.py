"""Side coders: how one side (keys ``"k"`` or values ``"v"``) of a layer is stored, one registered
class per mode, each behind the same interface (fit the shared layer part, encode a part, decode it).

* :class:`RawSide` (``"raw"``): a float cast (``k_fmt`` / ``v_fmt``; ``fp32`` is exact, ``fp8`` keeps
  an fp32 scale per token and head).
* :class:`QuantSide` (``"quant"``): KIVI-style plain int-N: keys per channel (groups of
  ``group_size`` tokens), values per token (groups of ``v_group_size`` channels).
* :class:`PcaSide` (``"pca"``): the KVTC-style codec. The shared part holds the side's mean and PCA
  basis -- per (layer, head), or over the concatenated heads of the layer (``joint_heads``) -- and
  the bits of every principal component (:mod:`.bits`; only the columns that get bits are stored,
  int or float with a scale per column). A part holds its tokens' coefficients, each component
  quantized at its own width in groups of ``group_size`` tokens (fp16 scale and minimum per group
  and component, the grid picked by least squared error; the bit-class layout is
  :mod:`kite.upcycle.format.bitlayout`), plus the attention sinks (positions < ``sink_tokens``) and
  optionally a few outlier tokens kept in fp16 with their indices. Keeping the sink exact is what
  makes low widths work: its value is near zero and takes most of the attention, so any error on
  it is multiplied.
  *Weighted* (``fit(..., weights=w)``, attention-aware distortion): the PCA of ``x * sqrt(w)``,
  stored as ``U / sqrt(w)`` so decoding is unchanged; the basis is then not orthonormal, so parts
  are encoded with its dual (coefficients of ``(x - mean) * w`` on the basis), and ``w`` is stored
  with the side (``{side}.w``, fp16). A side without ``{side}.w`` (every older state) projects as before.
* :class:`RegenSide` (``"rpca"``): ``pca`` on a regenerator's basis, not stored in the state.

A new mode is a subclass registered with :func:`register`; :data:`CODERS` lists them, and the codec
tests run over every preset that uses them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kite.kernels.eigh import batched_pca
from kite.upcycle.codec.bits import SideBudget, allocate_bits, expected_error, layer_budget_bits
from kite.upcycle.codec.blob import Blob, LayerCodec
from kite.upcycle.codec.quant import FLOAT_FORMATS, INT_FORMATS, QTensor, dequantize, quantize
from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.codec.state_bits import basis_header_bits
from kite.upcycle.format.bitlayout import class_layout, group_shape, parts_layout


class SideCoder(ABC):
    """One storage mode of a side. Subclasses set ``mode`` and implement encode and decode (fit
    has a default: a mode with no shared layer part)."""

    mode: ClassVar[str]

    def fit(self, side: str, X: torch.Tensor, s: CodecSettings, tensors: dict, meta: dict, *,
            pca=None, budget_tokens: int | None = None, weights: torch.Tensor | None = None,
            bits: torch.Tensor | None = None, budget: SideBudget | None = None) -> float | None:
        """Add the side's shared layer part to ``tensors`` / ``meta`` (X: [H, T, d] of the document).
        Returns the squared error the fit expects to leave where the mode can tell (else None).
        ``weights`` [B, D] (the blocks' dims, > 0): the distortion to minimise is the weighted
        squared error (attention-aware: :mod:`kite.upcycle.codec.weights`); modes with no basis
        ignore it."""
        meta[side] = {"mode": self.mode}
        return None

    @abstractmethod
    def encode(self, lc: LayerCodec, side: str, X: torch.Tensor, positions: torch.Tensor | None,
               widths: torch.Tensor | None = None) -> Blob:
        """A part: tokens X [H, T_sub, d] at ``positions`` in the document (None: unknown).
        ``widths``: the part's own bit width per stored column (PCA modes only; see :class:`PcaSide`)."""

    @abstractmethod
    def decode(self, lc: LayerCodec, side: str, blob: Blob) -> torch.Tensor:
        """The part back as float32 [H, T_sub, d]."""


CODERS: dict[str, SideCoder] = {}


def register(cls: type[SideCoder]) -> type[SideCoder]:
    CODERS[cls.mode] = cls()
    return cls


def coder(mode: str) -> SideCoder:
    try:
        return CODERS[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}") from None


def put_qtensor(tensors: dict, prefix: str, q: QTensor, qmeta: dict, key: str) -> None:
    for name, t in q.tensors.items():
        tensors[f"{prefix}.{name}"] = t
    qmeta[key] = q.meta


def get_qtensor(tensors: dict, prefix: str, qmeta: dict, key: str) -> QTensor:
    p = prefix + "."
    return QTensor({n[len(p):]: t for n, t in tensors.items() if n.startswith(p)}, qmeta[key])


def _no_widths(mode: str, widths) -> None:
    if widths is not None:
        raise ValueError(f"a {mode} side has no columns to give widths to (per-part widths need a PCA side)")


@register
class RawSide(SideCoder):
    mode = "raw"

    def encode(self, lc, side, X, positions, widths=None):
        _no_widths(self.mode, widths)
        s = lc.settings
        fmt = s.k_fmt if side == "k" else s.v_fmt
        tensors: dict[str, torch.Tensor] = {}
        meta: dict = {"T": X.shape[1]}
        put_qtensor(tensors, "x", quantize(X, fmt, group_size=0 if fmt != "fp8" else X.shape[2], axis=-1),
                    meta, "x")
        return Blob(tensors, meta)

    def decode(self, lc, side, blob):
        return dequantize(get_qtensor(blob.tensors, "x", blob.meta, "x"), torch.float32)


@register
class QuantSide(RawSide):
    mode = "quant"

    def encode(self, lc, side, X, positions, widths=None):
        _no_widths(self.mode, widths)
        s = lc.settings
        bits = int(round(s.k_bits if side == "k" else s.v_bits))
        if side == "k":  # KIVI: keys per channel (groups along tokens)
            q = quantize(X.float(), f"int{bits}", group_size=s.group_size, axis=-2)
        else:            # values per token (groups along channels)
            q = quantize(X.float(), f"int{bits}", group_size=s.v_group_size, axis=-1)
        tensors: dict[str, torch.Tensor] = {}
        meta: dict = {"T": X.shape[1]}
        put_qtensor(tensors, "x", q, meta, "x")
        return Blob(tensors, meta)


def blocks(X: torch.Tensor, joint: bool) -> torch.Tensor:
    """[H, T, d] -> [B, T, D]: per head (B=H, D=d) or joint (B=1, D=H*d)."""
    if joint:
        H, T, d = X.shape
        return X.permute(1, 0, 2).reshape(1, T, H * d)
    return X


def unblocks(Y: torch.Tensor, joint: bool, H: int, d: int) -> torch.Tensor:
    if joint:
        T = Y.shape[1]
        return Y.reshape(T, H, d).permute(1, 0, 2)
    return Y


def _store_float(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return t.to(FLOAT_FORMATS[fmt] if fmt != "fp8" else torch.float16).contiguous()


@register
class PcaSide(SideCoder):
    mode = "pca"

    def fit(self, side, X, s, tensors, meta, *, pca=None, budget_tokens=None, weights=None, bits=None,
            budget=None):
        """``weights``: a weighted PCA (the PCA of ``x * sqrt(w)``; stored basis ``U / sqrt(w)``, so
        decoding is unchanged and encoding uses the dual, :meth:`coefficients`); the weights are
        stored with the side (``{side}.w``, fp16, paid from the budget). ``bits`` [B, D]: each
        component's bits as allocated over the whole state (:mod:`.state_bits`), in place of the
        layer's own budget; ``budget``: the side's share of a state-wide budget (allocated here)."""
        H, T, d = X.shape
        T = budget_tokens or T  # the tokens the shared part's bytes are spread over
        Xb = blocks(X.float(), s.joint_heads)
        root = None
        if weights is not None:
            w = put_weights(tensors, side, weights, Xb.shape[0], Xb.shape[2])
            root = w.sqrt()
            mean_w, evals, U = batched_pca(Xb * root[:, None, :], center=s.center)
            mean, U = mean_w / root, U / root[:, :, None]
        else:
            mean, evals, U = pca if pca is not None else batched_pca(Xb, center=s.center)
        B, D = evals.shape
        if bits is None:
            avail, parts = _side_budget(budget, side, s, H, T, d, B, D)
            if weights is not None:
                avail -= B * D * 16
            bits = allocate_bits(evals, avail, T, D, s, parts=parts)
        bits = bits.long().cpu()
        r = int((bits > 0).sum(dim=1).max().item()) if bits.numel() else 0
        # components with bits are a prefix per block (greedy on desc eigvals mostly is); store the
        # columns that get bits, in order, and the bit vector per block
        tensors[f"{side}.mean"] = _store_float(mean, "fp32" if s.basis_fmt == "fp32" else "fp16")
        cols = [U[b][:, torch.nonzero(bits[b] > 0).flatten()] for b in range(B)]
        basis = torch.cat(cols, dim=1) if cols else torch.zeros(D, 0)
        if s.basis_fmt.startswith("int"):
            q = quantize(basis, s.basis_fmt, group_size=D, axis=-2)   # one scale per column
            put_qtensor(tensors, f"{side}.basis", q, meta, f"{side}.basis")
        else:
            tensors[f"{side}.basis"] = _store_float(basis, s.basis_fmt)
        tensors[f"{side}.bits"] = bits.to(torch.uint8).contiguous()
        meta[side] = {"mode": "pca", "blocks": B, "dim": D, "rank_max": r}
        return expected_error(evals, bits, s)

    @staticmethod
    def basis(lc: LayerCodec, side: str) -> torch.Tensor:
        """The stored columns [D, sum of ranks] as float32 (dequantized once per layer codec)."""
        key = f"{side}.basis"
        if key in lc.tensors:
            return lc.tensors[key].float()
        if lc.meta[side]["mode"] == RegenSide.mode and key not in lc.decoded:
            raise ValueError(f"layer codec side {side} is coded on a regenerator's basis: attach it first "
                             "(kite.upcycle.codec.attach_regenerator)")
        if key not in lc.decoded:
            lc.decoded[key] = dequantize(get_qtensor(lc.tensors, key, lc.meta, key), torch.float32)
        return lc.decoded[key]

    def coefficients(self, lc: LayerCodec, side: str, X: torch.Tensor) -> torch.Tensor:
        """Tokens X [H, T, d] on the layer's stored columns, block by block: [T, R] float32."""
        Xb = blocks(X.float(), lc.settings.joint_heads)     # [B, T, D]
        mean = lc.tensors[f"{side}.mean"].float()           # [B, D]
        basis = self.basis(lc, side)                        # [D, sum r_b]
        bits = lc.tensors[f"{side}.bits"].long()            # [B, D]
        Xc = Xb - mean[:, None, :]
        w = lc.tensors.get(f"{side}.w")
        if w is not None:   # a weighted basis U / sqrt(w): its dual is U * sqrt(w) = w * basis
            Xc = Xc * w.float().to(Xc.device)[:, None, :]
        coefs = []
        off = 0
        for b in range(Xb.shape[0]):
            r = int((bits[b] > 0).sum())
            coefs.append(Xc[b] @ basis[:, off:off + r])      # [T, r]
            off += r
        return torch.cat(coefs, dim=1) if coefs else Xc.new_zeros(X.shape[1], 0)

    @staticmethod
    def layer_widths(lc: LayerCodec, side: str) -> torch.Tensor:
        """The bit width of each stored column [R] as the layer codec allocated them."""
        bits = lc.tensors[f"{side}.bits"].long()
        return bits[bits > 0]

    @classmethod
    def part_widths(cls, lc: LayerCodec, side: str, blob: Blob) -> torch.Tensor:
        """The widths a part was coded at [R]: its own (``meta["bits"]``) or its layer's."""
        own = blob.meta.get("bits")
        if own is None:
            return cls.layer_widths(lc, side)
        return torch.tensor(own, dtype=torch.long, device=lc.tensors[f"{side}.bits"].device)

    def encode(self, lc, side, X, positions, widths=None, *, coefficients=None):
        """``widths`` [R] (0..max_bits per stored column, 0 = the column is not coded in this part):
        the part's own allocation (a per-label ratio), recorded in its meta as ``bits``; None codes
        it at its layer's widths. ``coefficients`` [T, R]: the tokens' coefficients on the stored
        columns when the caller has them (:meth:`coefficients` of X; a layer group's projection)."""
        s = lc.settings
        H, T, d = X.shape
        tensors: dict[str, torch.Tensor] = {}
        meta: dict = {"T": T}
        C = self.coefficients(lc, side, X) if coefficients is None else coefficients.float()   # [T, R]
        colbits = self.layer_widths(lc, side)
        if widths is not None:
            widths = torch.as_tensor(widths, dtype=torch.long).reshape(-1)
            if widths.numel() != colbits.numel() or bool(((widths < 0) | (widths > s.max_bits)).any()):
                raise ValueError(f"part widths: {colbits.numel()} values in 0..{s.max_bits} expected, got "
                                 f"{widths.tolist()}")
            meta["bits"] = widths.tolist()
            colbits = widths.to(colbits.device)
        forced = sinks(positions, s)
        if s.outliers > 0 or forced.numel():
            C = C.clone()                 # set_apart changes it (the caller's coefficients stay as they are)
        idx = set_apart(C, forced, s.outliers)
        if idx is not None:
            tensors["out.idx"] = idx.to(torch.int32 if T > 32767 else torch.int16)
            tensors["out.x"] = X.float()[:, idx, :].to(torch.float16).contiguous()        # [H, n, d]
        # one codes / scale / min tensor for all bit classes (the layout: format.bitlayout)
        coded = (_classes_on_device if C.is_cuda else _classes)(C, colbits.cpu(), T, s)
        if coded is not None:
            tensors["codes"], tensors["scale"], tensors["min"] = coded
        return Blob(tensors, meta)

    def decode(self, lc, side, blob):
        """The part as float32 [H, T, d], on the device of the layer codec's basis (the product with
        the basis runs there: a regenerator's columns attached on a GPU decode there)."""
        s = lc.settings
        H, d = lc.meta["H"], lc.meta["d"]
        T = blob.meta["T"]
        basis = self.basis(lc, side)
        dev = basis.device
        mean = lc.tensors[f"{side}.mean"].float().to(dev)
        bits = lc.tensors[f"{side}.bits"].long()
        B, D = bits.shape
        colbits = self.part_widths(lc, side, blob).cpu()
        Ct = torch.zeros(colbits.numel(), T)   # a column the part does not code stays 0: the mean
        co = go = 0
        for bw in sorted(set(colbits.tolist()) - {0}):
            sel = torch.nonzero(colbits == bw).flatten()
            qmeta, nb, ng = class_layout(T, sel.numel(), bw, s.group_size, s.even_groups)
            q = QTensor({"codes": blob.tensors["codes"][co:co + nb], "scale": blob.tensors["scale"][go:go + ng],
                         "min": blob.tensors["min"][go:go + ng]}, qmeta)
            co, go = co + nb, go + ng
            Ct[sel] = dequantize(q, torch.float32).t()      # whole rows: [n, T] as the codes lie
        C = Ct.to(dev).t().contiguous()
        Y = torch.empty(B, T, D, device=dev)
        off = 0
        for b in range(B):
            r = int((bits[b] > 0).sum())
            Y[b] = C[:, off:off + r] @ basis[:, off:off + r].T + mean[b]
            off += r
        X = unblocks(Y, s.joint_heads, H, d)
        if "out.idx" in blob.tensors:
            idx = blob.tensors["out.idx"].long().to(dev)
            X = X.clone()
            X[:, idx, :] = blob.tensors["out.x"].float().to(dev)
        return X


def sinks(positions: torch.Tensor | None, s: CodecSettings) -> torch.Tensor:
    """The rows of a part whose tokens are attention sinks (document positions < ``sink_tokens``),
    ascending, on the host; none where the positions are unknown (None)."""
    if positions is None or s.sink_tokens <= 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(positions.cpu() < s.sink_tokens).flatten()


def set_apart(C: torch.Tensor, forced: torch.Tensor, outliers: int) -> torch.Tensor | None:
    """The tokens a part keeps apart in fp16, as rows of its coefficients C [T, R]: the sinks ``forced``
    (rows, on the host), then ``outliers`` more whose coefficients are most extreme relative to their
    column's spread; ascending, on C's device; None where it keeps none. Their rows of C are set, in
    place, to the mean of the others: a neutral value that widens no group's range. With no outliers
    asked the rows are the sinks, known on the host: nothing here waits for the device."""
    T = C.shape[0]
    if not (outliers > 0 or forced.numel()) or T == 0 or C.shape[1] == 0:
        return None
    dev = C.device
    if outliers > 0:
        z = (C / C.std(dim=0, keepdim=True).clamp_min(1e-12)).abs().amax(dim=1)
        z[forced.to(dev)] = float("inf")
        idx = torch.topk(z, min(outliers + forced.numel(), T)).indices.sort().values   # (distinct)
        if idx.numel() < T:
            keep = torch.ones(T, dtype=torch.bool, device=dev)
            keep[idx] = False
            C[idx] = C[keep].mean(dim=0)
        return idx
    idx = forced.to(dev, non_blocking=True)
    if forced.numel() < T:
        keep = torch.ones(T, dtype=torch.bool)
        keep[forced] = False
        C[idx] = C.index_select(0, torch.nonzero(keep).flatten().to(dev, non_blocking=True)).mean(dim=0)
    return idx


def _classes(C: torch.Tensor, colbits: torch.Tensor, T: int, s: CodecSettings):
    """A part's coefficients C [T, R] quantized class by class (the columns of each width, widths
    ascending, each column in groups of the part's group size): (codes, scale, min) or None."""
    codes, scales, mins = [], [], []
    for bw in sorted(set(colbits.tolist()) - {0}):
        sel = torch.nonzero(colbits == bw).flatten()
        q = quantize(C[:, sel.to(C.device)], f"int{bw}", group_size=group_shape(T, s.group_size, s.even_groups)[0],
                     axis=-2, range_mode=s.range_mode)
        codes.append(q.tensors["codes"])
        scales.append(q.tensors["scale"])
        mins.append(q.tensors["min"])
    return (torch.cat(codes), torch.cat(scales), torch.cat(mins)) if codes else None


def _classes_on_device(C: torch.Tensor, colbits: torch.Tensor, T: int, s: CodecSettings):
    """:func:`_classes` in one launch on C's device (:func:`kite.kernels.quant.quantize_plan`, the
    batched encoder's kernel), the same bytes: each coded column a row of the plan, its tokens padded
    to whole groups with its last one, at the offsets the loaders read them from
    (:func:`kite.upcycle.format.bitlayout.parts_layout`)."""
    from kite.kernels.quant import quantize_plan

    cols = torch.nonzero(colbits > 0).flatten()
    if not cols.numel() or T == 0:
        return None
    row_bits = colbits[cols]
    R = int(cols.numel())
    bitoff, goff, gs = parts_layout(row_bits.numpy(), [T], s.group_size, s.even_groups)
    gs = int(gs[0])
    padded = -(-T // gs) * gs
    counts = torch.bincount(row_bits, minlength=s.max_bits + 1)
    n_bytes = sum((int(n) * padded * w + 7) // 8 for w, n in enumerate(counts.tolist()))
    n_scales = int(counts.sum()) * (padded // gs)
    n_g = padded // gs
    groups = torch.tensor([[0, g, g * gs, gs] for g in range(n_g)], dtype=torch.int64)
    dev = C.device
    # the plan goes to the device in one copy from pinned memory, which does not wait for the device
    plan = torch.cat([cols, row_bits, torch.from_numpy(bitoff).reshape(-1), torch.from_numpy(goff).reshape(-1),
                      groups.reshape(-1)])
    if dev.type == "cuda":
        plan = plan.pin_memory().to(dev, non_blocking=True)
    cols_d, row_bits_d, bitoff_d, goff_d, groups_d = plan.split([R, R, R, R, 4 * n_g])
    src = C[:, cols_d].t().float()                                                 # [R, T]
    if padded > T:
        src = torch.cat([src, src[:, -1:].expand(-1, padded - T)], dim=1)
    return quantize_plan(src.contiguous(), row_bits_d, bitoff_d.reshape(R, 1), goff_d.reshape(R, 1),
                         groups_d.reshape(n_g, 4), s.range_mode, n_bytes, n_scales, whole_bytes=False)


@register
class RegenSide(PcaSide):
    """``pca`` on a regenerator's basis (``kite upcycle train``): the state stores the document's
    mean, the bits of every component and the coefficients, not the basis. The bits follow the
    document's own variance on each calibrated component, with no basis column to pay for."""

    mode = "rpca"

    def fit(self, side, X, s, tensors, meta, *, pca=None, budget_tokens=None, weights=None, bits=None,
            budget=None):
        """``weights``: the regenerator's own (its basis is then weighted, ``U / sqrt(w)``); stored
        with the side as :class:`PcaSide` does, so a part can be encoded from the state alone.
        ``bits`` [B, D]: each component's bits as allocated over the whole state on these same
        components (:mod:`.groups`), in place of an allocation here (nothing is expected then)."""
        if pca is None:
            raise ValueError("rpca needs the regenerator's (mean, variances, basis) for this layer and side")
        H, T, d = X.shape
        T = budget_tokens or T
        Xb = blocks(X.float(), s.joint_heads)                       # [B, T, D]
        B, D = pca[2].shape[0], pca[2].shape[1]
        mean = Xb.mean(dim=1) if s.center else Xb.new_zeros(B, D)
        Xc = Xb - mean[:, None, :]
        avail, parts = _side_budget(budget, side, s, H, T, d, B, D)
        if budget is not None:   # the budget was made with a stored basis: its header rows are free here
            avail += basis_header_bits(s, H, d, B, D)
        if weights is not None:
            Xc = Xc * put_weights(tensors, side, weights, B, D).to(Xc.device)[:, None, :]
            avail -= B * D * 16
        variances = None
        if bits is None:
            U = pca[2].to(Xb.device, torch.float32)                  # [B, D, D]
            variances = torch.matmul(Xc, U).pow(2).mean(dim=1)      # [B, D]
            bits = allocate_bits(variances, avail, T, D, s, basis_stored=False, parts=parts)
        bits = bits.long().cpu()
        tensors[f"{side}.mean"] = _store_float(mean, "fp32" if s.basis_fmt == "fp32" else "fp16")
        tensors[f"{side}.bits"] = bits.to(torch.uint8).contiguous()
        meta[side] = {"mode": self.mode, "blocks": B, "dim": D,
                      "rank_max": int((bits > 0).sum(dim=1).max().item()) if bits.numel() else 0}
        return None if variances is None else expected_error(variances, bits, s)


def _side_budget(budget: SideBudget | None, side: str, s: CodecSettings, H: int, T: int, d: int, B: int,
                 D: int) -> tuple[float, tuple | None]:
    """(bits the side's components may take, its parts' token counts or None): the state-wide
    budget's share when given, else the layer's own budget."""
    if budget is not None:
        return float(budget.bits), budget.parts
    return layer_budget_bits(s.k_bits if side == "k" else s.v_bits, H, T, d, B, D, s), None


def put_weights(tensors: dict, side: str, weights: torch.Tensor, B: int, D: int) -> torch.Tensor:
    """Store a side's distortion weights [B, D] (fp16, ``{side}.w``) and return them as stored
    (float32), so the fit and every later encode use the same numbers."""
    w = torch.as_tensor(weights).float().reshape(-1)
    if w.numel() != B * D or not bool(torch.isfinite(w).all()) or bool((w <= 0).any()):
        raise ValueError(f"distortion weights must be {B}x{D} positive finite numbers, got {tuple(weights.shape)}")
    w16 = w.reshape(B, D).to(torch.float16).clamp_min(torch.finfo(torch.float16).tiny).contiguous()
    tensors[f"{side}.w"] = w16
    return w16.float()


def regen_columns(basis: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The columns of a regenerator basis [B, D, D] a layer codec's ``bits`` [B, D] keep, as the
    stored basis of a ``pca`` side would lie: [D, sum of ranks], block by block."""
    cols = [basis[b][:, torch.nonzero(bits[b] > 0).flatten()] for b in range(basis.shape[0])]
    return torch.cat(cols, dim=1).float().contiguous() if cols else basis.new_zeros(basis.shape[1], 0)


def attach_regenerator(lc: LayerCodec, bases: dict[str, torch.Tensor], sides=("k", "v"), device=None) -> LayerCodec:
    """Give the ``rpca`` sides of a layer codec their regenerator columns (``bases``: side -> the
    regenerator's basis [B, D, D] of this layer), on ``device`` (default: where the codec's mean
    is; decoding multiplies by them there). Sides of other modes are left alone."""
    for side in sides:
        if lc.meta[side]["mode"] == RegenSide.mode:
            cols = regen_columns(bases[side], lc.tensors[f"{side}.bits"].long().cpu())
            lc.decoded[f"{side}.basis"] = cols.to(device if device is not None else lc.tensors[f"{side}.mean"].device)
    return lc


__all__ = ["CODERS", "INT_FORMATS", "PcaSide", "QuantSide", "RawSide", "RegenSide", "SideCoder", "attach_regenerator",
           "coder", "put_weights", "regen_columns", "register", "set_apart", "sinks"]
