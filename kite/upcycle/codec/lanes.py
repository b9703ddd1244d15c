"""Nibble lanes, the encoder: a loaded state's KV coded again into the form the lanes decode kernel
reads (the form, its decoder and the kernel's torch reference: kite.kernels.lanes; the kernel:
kite.kernels.lanes_triton).

Per layer and KV head, a state's keys (post-RoPE, as the cache holds them) and values are each
projected on a basis of their own (the PCA of that head's tokens, components by falling variance)
and coded in 4-bit lanes: a component gets 0, 1 or 2 lanes (0, 4 or 8 bits, chosen greedily by
expected error from the components' variances, :func:`allocate_lanes`), R lanes in all, R a power
of 2 (R = d: 4 bits an element, 4x fewer code bytes than bf16; R = d / 2: 8x). Rows are quantized in
groups of ``group`` rows (per group and lane a weight, per group a constant in the d space); the
first ``sinks`` tokens stay exact. :func:`nbytes_for` is the form's size by arithmetic.
"""

from __future__ import annotations

import math

import torch

from kite.kernels.lanes import LANE_BITS, Lanes, quad_order
from kite.kernels.quant import GAUSS_STEP, MSE_GRID

__all__ = ["CLIPS", "MAX_LANES", "allocate_lanes", "encode", "encode_layers", "nbytes_for"]

MAX_LANES = 2          # lanes a component may take (8 bits)
CLIPS = ("minmax", "mse")


def nbytes_for(tokens: int, heads: int, head_dim: int, k_lanes: int, v_lanes: int, group: int = 512,
               sinks: int = 1, basis_bytes: int = 2, table_bytes: int = 4) -> int:
    """:meth:`kite.kernels.lanes.Lanes.nbytes` of one layer of one state of ``tokens`` tokens, by arithmetic (what
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
