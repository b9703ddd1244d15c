"""Nibble lanes: a resident coded form that decode attention reads near its byte floor (issue 17).

Per layer and KV head, a state's keys (post-RoPE, as the cache holds them) and values are each
projected on a basis of their own (the PCA of that head's tokens, components by falling variance)
and coded in 4-bit *lanes*: a component gets 0, 1 or 2 lanes (0, 4 or 8 bits, chosen greedily by
expected error from the components' variances), R lanes in all, R a power of 2 (R = d: 4 bits an
element, 4x fewer code bytes than bf16; R = d / 2: 8x). A row's R lanes are R / 2 bytes: byte c
holds lane c in its low nibble and lane R / 2 + c in its high one. Key codes are stored row by row
([rows, R / 2]); value codes lane-byte by lane-byte within each group ([groups, R / 2, group]), so
that the decode kernel, whose value product runs over rows, reads four rows of a lane in one word;
in each such word the rows are stored in the order 0, 2, 1, 3 (:func:`quad_order`: the order in
which the kernel's unpacking of one word yields its nibbles). :func:`row_codes` gives the rows back.

Rows are quantized in groups of ``group`` rows: per group and lane a weight (the coefficient a unit
of that nibble is worth: the component's quantization step, times 16 for the high nibble of an
8-bit component) and per group a constant in the d space (the mean, plus every component's group
minimum, plus the components coded at 0 bits as their group mean). So a row is

    x_t = Σ_c n_tc · w_g(t),c · b_c + κ_g(t)          (b_c: the basis row of lane c's component)

and attention needs no rebuilt row: a query's score is Σ_c n_tc (w_gc (b_c · q)) + κ_g · q, a
product of the nibbles with the query projected once per head and scaled once per group; values
accumulate as Σ_t p_t n_t in lane space, scaled per group, projected on the basis once at the end.
That is the work of ``kite.kernels.lanes_triton.lanes_decode`` (which imports this module, not the
other way); :func:`lanes_partial_torch` is its reference and CPU path, :func:`decode` the rows
themselves.

The first ``sinks`` tokens (attention sinks) stay exact in a small raw side (post-RoPE keys).
A :class:`Lanes` holds one layer of N states stacked (N = 1 for one state); :func:`stack` stacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from kite.kernels.quant import GAUSS_STEP, MSE_GRID

__all__ = ["Lanes", "allocate_lanes", "decode", "encode", "encode_layers", "lanes_partial", "lanes_partial_torch", "nbytes_for",
           "quad_order", "row_codes", "stack"]

LANE_BITS = 4
MAX_LANES = 2          # lanes a component may take (8 bits)
CLIPS = ("minmax", "mse")


@dataclass
class Lanes:
    """One layer of N states in nibble lanes. Shapes: H KV heads of d dims, Tp rows (a multiple of
    ``group``; rows >= ``length[n]`` are padding), G = Tp / group groups, Rk / Rv lanes."""

    k_codes: torch.Tensor     # uint8 [N, H, Tp, Rk / 2]
    k_weight: torch.Tensor    # float32 [N, H, G, Rk]: a nibble's coefficient, per group and lane
    k_const: torch.Tensor     # float32 [N, H, G, d]
    k_basis: torch.Tensor     # float32 [N, H, Rk, d]: lane c's component
    v_codes: torch.Tensor     # uint8 [N, H, G, Rv / 2, group]: lane-major within a group, rows in
                              # quad_order (row_codes gives the rows)
    v_weight: torch.Tensor
    v_const: torch.Tensor
    v_basis: torch.Tensor
    length: torch.Tensor      # int32 [N]: coded rows of each state
    raw_k: torch.Tensor       # [N, H, S, d]: the sinks, keys post-RoPE
    raw_v: torch.Tensor
    group: int

    @property
    def states(self) -> int:
        return int(self.k_codes.shape[0])

    @property
    def rows(self) -> int:
        return int(self.k_codes.shape[2])

    def nbytes(self, basis_bytes: int = 2, table_bytes: int = 4) -> int:
        """Bytes of this form as the GPU holds it: codes, per-group tables (``table_bytes`` an entry),
        bases (``basis_bytes`` an entry, one row per lane, as the kernel reads them: a component of two
        lanes has its row twice) and sinks (bf16)."""
        total = 0
        for side in "kv":
            codes, weight, const, basis = (getattr(self, f"{side}_{f}") for f in ("codes", "weight", "const", "basis"))
            total += codes.numel() + (weight.numel() + const.numel()) * table_bytes
            total += basis.numel() * basis_bytes
        return total + (self.raw_k.numel() + self.raw_v.numel()) * 2

    def to(self, device=None, basis_dtype=None) -> "Lanes":
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if torch.is_tensor(getattr(self, f.name))}
        if basis_dtype is not None:
            moved["k_basis"], moved["v_basis"] = moved["k_basis"].to(basis_dtype), moved["v_basis"].to(basis_dtype)
        return replace(self, **moved)


def nbytes_for(tokens: int, heads: int, head_dim: int, k_lanes: int, v_lanes: int, group: int = 512,
               sinks: int = 1, basis_bytes: int = 2, table_bytes: int = 4) -> int:
    """:meth:`Lanes.nbytes` of one layer of one state of ``tokens`` tokens, by arithmetic (what
    :func:`encode` would make, without coding anything: capacity planning)."""
    s = min(max(sinks, 0), tokens)
    groups = max(1, math.ceil((tokens - s) / group))
    total = 0
    for lanes in (k_lanes, v_lanes):
        total += heads * groups * group * lanes // 2                          # codes
        total += heads * groups * (lanes + head_dim) * table_bytes             # weights, constants
        total += heads * lanes * head_dim * basis_bytes                        # basis
    return total + 2 * heads * s * head_dim * 2                                # sinks (bf16)


def allocate_lanes(variances: torch.Tensor, lanes: int) -> torch.Tensor:
    """Lanes per component (int64 [..., d], each 0..MAX_LANES, ``lanes`` in all per row) from the
    components' variances [..., d]: greedily where a lane takes the most expected squared error
    (a component at b bits keeps ~ variance · 2^(-2b) of it)."""
    d = variances.shape[-1]
    if not 0 < lanes <= MAX_LANES * d:
        raise ValueError(f"lanes must be in 1..{MAX_LANES * d} for {d} components, not {lanes}")
    var = variances.clamp_min(0).double()
    step = 2.0 ** (-2 * LANE_BITS)
    # the gain of a component's first lane, then of its second: var (1 - step), var step (1 - step)
    gains = torch.cat((var * (1 - step), var * step * (1 - step)), dim=-1)          # [..., 2d]
    top = gains.topk(lanes, dim=-1).indices
    taken = torch.zeros_like(gains, dtype=torch.int64).scatter_(-1, top, 1)
    return taken[..., :d] + taken[..., d:]     # a second lane's gain is below its first's: never one without


def _grid(cg: torch.Tensor, vg: torch.Tensor, n_lanes: torch.Tensor, clip: str
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's and coded component's quantization grid (minimum, step) [H, G, d] from its
    coefficients cg [H, G, group, d] (valid rows: vg [H, G, group, 1]) at its bits (n_lanes [H, d]).

    ``clip="minmax"``: the group's range; ``"mse"``: the grid of least squared error among the
    min/max one and Gaussian-optimal steps around the group's mean (as kite.kernels.quant does for
    the codec's coefficients), clipping the rare far tails for a finer step on the rest."""
    big = torch.finfo(torch.float32).max
    lo = torch.where(vg, cg, big).amin(dim=2)                                       # [H, G, d]
    hi = torch.where(vg, cg, -big).amax(dim=2)
    empty = vg.sum(dim=2) == 0
    lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    levels = (2.0 ** (LANE_BITS * n_lanes) - 1).float()[:, None, :]                 # [H, 1, d]
    coded = n_lanes[:, None, :] > 0
    step = torch.where(coded, (hi - lo) / levels.clamp_min(1), 0.0)
    if clip == "minmax":
        return lo, step
    cnt = vg.sum(dim=2).clamp_min(1)
    mu = torch.where(vg, cg, 0.0).sum(dim=2) / cnt
    sd = (torch.where(vg, cg - mu[:, :, None], 0.0).pow(2).sum(dim=2) / cnt).sqrt()
    gauss = torch.tensor([GAUSS_STEP.get(int(b) * LANE_BITS, 0.0) for b in n_lanes.flatten()],
                         device=cg.device).view(n_lanes.shape)[:, None, :]          # [H, 1, d]

    def sq_err(mn: torch.Tensor, st: torch.Tensor) -> torch.Tensor:
        q = ((cg - mn[:, :, None]) / st[:, :, None].clamp_min(1e-30)).round()
        q = torch.minimum(q.clamp_min(0), levels[:, :, None])
        return torch.where(vg, mn[:, :, None] + q * st[:, :, None] - cg, 0.0).pow(2).sum(dim=2)

    best = sq_err(lo, step)
    for f in MSE_GRID:
        st = torch.where(coded, sd * gauss * f, 0.0)
        mn = mu - st * levels / 2
        err = sq_err(mn, st)
        better = (err < best) & (st > 0)
        best, lo, step = torch.where(better, err, best), torch.where(better, mn, lo), torch.where(better, st, step)
    return lo, step


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One side [H, T, d] (float32): its mean [H, 1, d] and covariance [H, d, d] over the tokens."""
    H, T, d = x.shape
    mean = x.mean(dim=1, keepdim=True) if T else x.new_zeros(H, 1, d)
    xc = x - mean
    return mean, xc.transpose(1, 2) @ xc / max(T, 1)


def _side(x: torch.Tensor, mean: torch.Tensor, evals: torch.Tensor, evecs: torch.Tensor, lanes: int, group: int,
          clip: str) -> dict:
    """One side [H, T, d] (float32) of one state in lanes: codes, weights, constants, basis (see Lanes),
    from its mean and its covariance's eigenpairs (descending; columns of ``evecs``)."""
    H, T, d = x.shape
    G = max(1, math.ceil(T / group))
    Tp = G * group
    xc = x - mean
    basis = evecs.transpose(1, 2).float()                                            # [H, d, d]: rows = components
    var = evals.float()
    n_lanes = allocate_lanes(var, lanes)                                            # [H, d]
    coef = xc @ basis.transpose(1, 2)                                               # [H, T, d]
    dev = x.device
    pad = torch.zeros(H, Tp - T, d, device=dev)
    valid = (torch.arange(Tp, device=dev) < T)[None, :, None].expand(H, Tp, 1)
    cg = torch.cat((coef, pad), dim=1).view(H, G, group, d)
    vg = valid.reshape(H, G, group, 1)
    cnt = vg.sum(dim=2).clamp_min(1)
    gmean = torch.where(vg, cg, 0.0).sum(dim=2) / cnt
    lo, step = _grid(cg, vg, n_lanes, clip)
    levels = (2.0 ** (LANE_BITS * n_lanes) - 1).float()[:, None, :]                 # [H, 1, d]
    q = torch.where((step[:, :, None] > 0) & vg,
                    ((cg - lo[:, :, None]) / step[:, :, None].clamp_min(1e-30)).round(),
                    torch.zeros((), device=dev))                                    # padding rows: code 0
    q = torch.minimum(q.clamp_min(0), levels[:, :, None]).to(torch.int64)         # [H, G, group, d]
    # the constant row of each group: mean + Σ_kept lo_j b_j + Σ_dropped gmean_j b_j
    base = torch.where(n_lanes[:, None, :] > 0, lo, gmean)                           # [H, G, d] in components
    const = base @ basis + mean                                                     # [H, G, d]
    # lanes: per head the (component, nibble) of each lane, low nibbles of every coded component first
    codes = torch.zeros(H, Tp, lanes, dtype=torch.uint8, device=dev)
    weight = torch.zeros(H, G, lanes, device=dev)
    lbasis = torch.zeros(H, lanes, d, device=dev)
    qf = q.view(H, Tp, d)
    for h in range(H):
        first = torch.nonzero(n_lanes[h] >= 1).flatten()
        second = torch.nonzero(n_lanes[h] >= 2).flatten()
        comp = torch.cat((first, second))
        shift = torch.cat((torch.zeros_like(first), torch.full_like(second, LANE_BITS)))
        codes[h] = ((qf[h][:, comp] >> shift) & 15).to(torch.uint8)
        weight[h] = step[h][:, comp] * (2.0 ** shift).float()
        lbasis[h] = basis[h][comp]
    half = lanes // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)
    return {"codes": packed.contiguous(), "weight": weight, "const": const.float(), "basis": lbasis}


def encode(keys: torch.Tensor, values: torch.Tensor, k_lanes: int, v_lanes: int | None = None,
           group: int = 512, sinks: int = 1, clip: str = "minmax") -> Lanes:
    """One layer of one state in lanes (N = 1): ``keys`` (post-RoPE) and ``values`` [H, T, d];
    ``k_lanes`` / ``v_lanes`` lanes a row (even powers of 2 <= 2d; d: 4 bits an element), groups of
    ``group`` rows, the first ``sinks`` tokens kept exact; ``clip``: each group's quantization range
    (``"minmax"``, or ``"mse"``: clipped to the least squared error, see :func:`_grid`)."""
    return encode_layers([keys], [values], k_lanes, v_lanes, group=group, sinks=sinks, clip=clip)[0]


def encode_layers(keys: list[torch.Tensor], values: list[torch.Tensor], k_lanes: int, v_lanes: int | None = None,
                  group: int = 512, sinks: int = 1, clip: str = "minmax") -> list[Lanes]:
    """:func:`encode` of each layer of one state (``keys[i]`` / ``values[i]`` [H, T_i, d]), the PCA
    of every layer, side and head in one call of the batched eigensolver (kite.kernels.eigh: on a
    GPU one launch, instead of a solver call per layer and side)."""
    from kite.kernels.eigh import eigh_desc

    v_lanes = k_lanes if v_lanes is None else v_lanes
    if not keys or len(keys) != len(values):
        raise ValueError(f"{len(keys)} layers of keys and {len(values)} of values")
    H, _, d = keys[0].shape
    for name, r in (("k_lanes", k_lanes), ("v_lanes", v_lanes)):
        if r < 2 or r & (r - 1) or r > MAX_LANES * d:
            raise ValueError(f"{name} must be a power of 2 in 2..{MAX_LANES * d}, not {r}")
    if group < 1:
        raise ValueError(f"group must be >= 1, not {group}")
    if clip not in CLIPS:
        raise ValueError(f"clip must be one of {CLIPS}, not {clip!r}")
    cut = [min(max(sinks, 0), k.shape[1]) for k in keys]
    sides = [x[:, s:].float() for k, v, s in zip(keys, values, cut) for x in (k, v)]   # k0, v0, k1, v1 ...
    moments = [_moments(x) for x in sides]
    cov = torch.cat([c for _, c in moments])                                        # [2 L H, d, d]
    evals, evecs = eigh_desc(cov if cov.is_cuda else cov.double())
    out = []
    for i, (k, v, s) in enumerate(zip(keys, values, cut)):
        part = []
        for j, lanes in ((2 * i, k_lanes), (2 * i + 1, v_lanes)):
            rows = slice(j * H, (j + 1) * H)
            part.append(_side(sides[j], moments[j][0], evals[rows], evecs[rows], lanes, group, clip))
        ks, vs = part
        order = quad_order(group, k.device)
        vs["codes"] = vs["codes"].view(H, -1, group, v_lanes // 2).transpose(-1, -2)[..., order].contiguous()
        out.append(Lanes(k_codes=ks["codes"][None], k_weight=ks["weight"][None], k_const=ks["const"][None],
                         k_basis=ks["basis"][None], v_codes=vs["codes"][None], v_weight=vs["weight"][None],
                         v_const=vs["const"][None], v_basis=vs["basis"][None],
                         length=torch.tensor([k.shape[1] - s], dtype=torch.int32, device=k.device),
                         raw_k=k[None, :, :s].clone(), raw_v=v[None, :, :s].clone(), group=group))
    return out


def _unpack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., R / 2] -> the R nibbles [..., R] (float32)."""
    return torch.cat((codes & 15, codes >> 4), dim=-1).float()


def quad_order(n: int, device=None) -> torch.Tensor:
    """Positions 0..n-1 with the middle two of each whole quad swapped (0, 2, 1, 3, 4, 6, 5, 7, ...):
    the order of a group's value rows in :attr:`Lanes.v_codes`. The decode kernel unpacks four code
    bytes (one register) with two mask operations on the word and on the word shifted by a byte,
    which yields the nibbles of bytes 0, 2, 1, 3; stored so, they come out in row order. The order
    is its own inverse."""
    i = torch.arange(n, device=device)
    swapped = (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1)
    return torch.where(i < n // 4 * 4, swapped, i)


def row_codes(lanes: Lanes, side: str) -> torch.Tensor:
    """A side's codes row by row, uint8 [N, H, Tp, R / 2] (the value codes' lane-major groups
    transposed back to rows in order: a copy)."""
    if side == "k":
        return lanes.k_codes
    N, H, G, half, group = lanes.v_codes.shape
    rows = lanes.v_codes[..., quad_order(group, lanes.v_codes.device)]
    return rows.transpose(-1, -2).reshape(N, H, G * group, half)


def _coefs(lanes: Lanes, side: str) -> torch.Tensor:
    """Each row's lane coefficients (nibble x its group's weight): float32 [N, H, Tp, R]."""
    weight = getattr(lanes, f"{side}_weight")
    return _unpack(row_codes(lanes, side)) * weight.float().repeat_interleave(lanes.group, dim=2)


def decode(lanes: Lanes, side: str) -> torch.Tensor:
    """The coded rows of a side, sinks first: float32 [N, H, S + Tp, d] (padding rows after each
    state's ``length`` hold its last group's constant)."""
    if side not in ("k", "v"):
        raise ValueError(f"side must be 'k' or 'v', not {side!r}")
    basis, const = getattr(lanes, f"{side}_basis").float(), getattr(lanes, f"{side}_const").float()
    rows = _coefs(lanes, side) @ basis + const.repeat_interleave(lanes.group, dim=2)
    raw = (lanes.raw_k if side == "k" else lanes.raw_v).float()
    return torch.cat((raw, rows), dim=2)


def lanes_partial_torch(q: torch.Tensor, lanes: Lanes, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, Hq, d] (one token per state) or [N, Hq, n, d] (n tokens after the state,
    each seeing all of it) over each state's coded rows (sinks not included): (out of q's shape,
    lse [N, Hq(, n)]) float32, as kite.kernels.coded_attention's parts."""
    tokens = q.dim() == 4
    q4 = q if tokens else q[:, :, None]
    N, Hq, n, d = q4.shape
    H = lanes.k_codes.shape[1]
    G = Hq // H
    qh = q4.float().reshape(N, H, G * n, d)
    k = decode(lanes, "k")[:, :, lanes.raw_k.shape[2]:]
    v = decode(lanes, "v")[:, :, lanes.raw_v.shape[2]:]
    sc = (qh @ k.transpose(-1, -2)) * scale                                          # [N, H, G n, Tp]
    live = torch.arange(lanes.rows, device=q.device)[None, :] < lanes.length.to(q.device)[:, None].long()
    sc = sc.masked_fill(~live[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(sc, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = (torch.exp(sc - safe[..., None]) @ v).reshape(N, Hq, n, d)
    lse = lse.reshape(N, Hq, n)
    return (out, lse) if tokens else (out[:, :, 0], lse[:, :, 0])


def lanes_partial(q: torch.Tensor, lanes: Lanes, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The coded rows and the sinks of each state, one softmax, for q [N, Hq, d] or [N, Hq, n, d]
    (lanes_partial_torch's shapes): the torch reference, on any device. The GPU decode kernel is
    ``kite.kernels.lanes_triton.lanes_decode`` (one token a state; the sinks as its raw rows)."""
    coded = lanes_partial_torch(q, lanes, scale)
    if lanes.raw_k.shape[2] == 0:
        return coded
    from kite.kernels.coded_attention import merge, raw_partial

    if q.dim() == 4:
        return merge([coded, raw_partial(q, lanes.raw_k, lanes.raw_v, scale)])
    ro, rl = raw_partial(q[:, :, None], lanes.raw_k, lanes.raw_v, scale)
    return merge([coded, (ro[:, :, 0], rl[:, :, 0])])


def stack(layers: list[Lanes]) -> Lanes:
    """States' layers stacked into one (N = the sum of theirs), rows padded to the longest. States of
    different group sizes or numbers of sinks are refused (a padded sink row would take attention)."""
    if not layers:
        raise ValueError("nothing to stack")
    group = layers[0].group
    if any(x.group != group for x in layers):
        raise ValueError("states of different group sizes cannot be stacked")
    if any(x.raw_k.shape[2] != layers[0].raw_k.shape[2] for x in layers):
        raise ValueError("states with different numbers of sinks cannot be stacked")
    Tp = max(x.rows for x in layers)

    def pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        if t.shape[dim] == size:
            return t
        shape = list(t.shape)
        shape[dim] = size - t.shape[dim]
        return torch.cat((t, t.new_zeros(shape)), dim=dim)

    out = {}
    for f in fields(Lanes):
        if f.name == "group":
            continue
        parts = [getattr(x, f.name) for x in layers]
        if f.name == "k_codes":
            parts = [pad(t, 2, Tp) for t in parts]
        elif f.name.endswith(("_weight", "_const")) or f.name == "v_codes":
            parts = [pad(t, 2, Tp // group) for t in parts]
        out[f.name] = torch.cat(parts, dim=0)
    return Lanes(group=group, **out)
