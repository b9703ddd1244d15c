"""Nibble lanes, the form the lanes decode kernel reads: its layout (:class:`Lanes`), its decoder and
the kernel's torch reference. The encoder that codes a state into it is Upcycle's
(kite.upcycle.codec.lanes); the GPU kernel is kite.kernels.lanes_triton.

Per layer and KV head, a state's keys (post-RoPE, as the cache holds them) and values are each
projected on a basis of their own and coded in 4-bit *lanes*: a component gets 0, 1 or 2 lanes
(0, 4 or 8 bits), R lanes in all, R a power of 2. A row's R lanes are R / 2 bytes: byte c holds
lane c in its low nibble and lane R / 2 + c in its high one. Key codes are stored row by row
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

from dataclasses import dataclass, fields, replace

import torch

from kite.kernels.partials import merge, raw_partial

__all__ = ["LANE_BITS", "Lanes", "decode", "lanes_partial", "lanes_partial_torch", "quad_order", "row_codes", "stack"]

LANE_BITS = 4          # bits a lane


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
    lse [N, Hq(, n)]) float32, a part kite.kernels.partials.merge takes."""
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
