"""The batched encoder's fit: both sides' Grams, one eigendecomposition of every block of both sides
(:func:`kite.kernels.eigh.eigh_desc`: the native Jacobi kernel for blocks of d <= 128 on a GPU,
cuSOLVER's batched solver for larger blocks such as joint heads), the bit allocations, and the
stored bases, all queued on a side stream without waiting for the device.

Stored basis: each block's columns that get bits become rows of a [L, B, D, D] basis (a scatter by
rank; rows past a block's last column stay zero), quantized in one launch per side
(:func:`kite.kernels.quant.quantize_plan`, which also writes the decoded basis encode projects on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kite.kernels.eigh import centered_gram, eigh_desc
from kite.kernels.quant import quantize_plan
from kite.kernels.streams import StageClock, on_side_stream, tf32, to_dev
from kite.upcycle.codec.batched_regen import choose
from kite.upcycle.codec.bits import allocate_bits_batched, layer_budget_bits
from kite.upcycle.codec.quant import FLOAT_FORMATS, INT_FORMATS
from kite.upcycle.codec.layer import state_budgeted
from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.codec.state_bits import allocate_state
from kite.upcycle.format.bitlayout import runs_plan


def state_blocks(X: torch.Tensor, s: CodecSettings) -> tuple[torch.Tensor, int, int]:
    """One side's data as the PCA's blocks: [L*B, T, D] with B = 1, D = H*d (joint heads) or B = H, D = d."""
    L, H, T, d = X.shape
    if s.joint_heads:
        return X.permute(0, 2, 1, 3).reshape(L, T, H * d), 1, H * d
    return X.reshape(L * H, T, d), H, d


@dataclass
class Fitted:
    """One side's fit, on the device: what encode projects on and what the layer blobs store."""

    shape: tuple[int, int, int, int]   # L, H, T, d
    B: int
    D: int
    mean_st: torch.Tensor      # [L, B, D] the stored means (fp16, or fp32 with an fp32 basis)
    bits: torch.Tensor         # [L, B, D] int64: each component's bits
    solved: torch.Tensor       # [L, B] bool: the eigensolver converged
    row_bits: torch.Tensor     # [L, B*D] int64: bits of the stored column in each basis row (0: none)
    basis: torch.Tensor        # [L, B, D, D] float32: row (l, b, j) = block b's j-th stored column, as decoded
    stored: dict               # the basis as stored: int formats {"packed", "scale", "min", "plan"}, else {"rows"}
    regen: torch.Tensor | None = None   # [L] bool: the layer is coded on the regenerator's basis (none stored)


def stored_basis(U: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """U [L, B, D, D] (column i = component i), bits [L, B, D] -> the stored columns as rows, block by
    block in component order (row_bits [L, B*D], rows [L, B, D, D]; rows past a block's last stored
    column are zero), by a scatter on the device."""
    L, B, D, _ = U.shape
    sel = bits > 0
    slot = torch.where(sel, sel.long().cumsum(2) - 1, torch.full_like(bits, D))   # slot D: dropped
    rows = torch.zeros(L, B, D + 1, D, dtype=torch.float32, device=U.device)
    rows.scatter_(2, slot[..., None].expand(L, B, D, D), U.transpose(2, 3).float())
    row_bits = torch.zeros(L, B, D + 1, dtype=torch.int64, device=U.device).scatter_(2, slot, bits)
    return row_bits[:, :, :D].reshape(L, B * D).contiguous(), rows[:, :, :D].contiguous()


def quantize_basis(rows: torch.Tensor, row_bits: torch.Tensor, s: CodecSettings) -> tuple[torch.Tensor, dict]:
    """The stored basis (the per-layer codec's: int formats quantize each column of D values, min/max) and
    what encode projects on (the decoded basis), in one launch for every layer."""
    L, B, D, _ = rows.shape
    if not s.basis_fmt.startswith("int"):
        stored = rows.to(FLOAT_FORMATS[s.basis_fmt])
        return stored.float(), {"rows": stored}
    bb = INT_FORMATS[s.basis_fmt]
    dev = rows.device
    rb = torch.where(row_bits > 0, bb, 0)
    ng, gs, groups = to_dev(dev, torch.ones(1, dtype=torch.long), torch.tensor([D]), torch.tensor([[0, 0, 0, D]]))
    plan = runs_plan(rb, ng, gs, bb)
    n_bytes, n_sc = plan.sizes((L * B * D * D * bb // 8 + L, L * B * D))
    flat = rows.view(L * B * D, D)
    deq = torch.zeros_like(flat)
    packed, scale, mn = quantize_plan(flat, rb.view(-1), plan.base_bit, plan.base_sc, groups, "minmax",
                                      n_bytes, n_sc, whole_bytes=(D * bb) % 8 == 0, deq=deq)
    return deq.view(L, B, D, D), {"packed": packed, "scale": scale, "min": mn, "plan": plan}


@dataclass
class Solved:
    """Both sides' eigendecompositions, queued on the fit stream (:func:`solve_launch`)."""

    sides: dict                # prefix -> (X, bits per element)
    shapes: dict               # prefix -> ((L, H, T, d), B, D)
    mean_st: dict              # prefix -> [L, B, D] the stored means
    evals: torch.Tensor        # [sum L*B, D] every block of both sides, descending
    U: torch.Tensor


def solve_launch(sides: dict[str, tuple[torch.Tensor, float]], s: CodecSettings, clock: StageClock) -> Solved:
    """Queue both sides' Grams (X: [L, H, T, d] float32 on the device), then on the fit stream one
    batched eigendecomposition for every block of both sides. Nothing here waits for the device."""
    means, grams, shapes = {}, [], {}
    with tf32(clock.dev):
        for prefix, (X, _) in sides.items():
            if s.joint_heads and X.is_cuda:
                means[prefix], G = joint_gram_fused(X, s.center)
                B, D = 1, X.shape[1] * X.shape[3]
            else:
                Xb, B, D = state_blocks(X, s)
                means[prefix], G = centered_gram(Xb, center=s.center)              # [L*B, D], [L*B, D, D]
                del Xb
            grams.append(G)
            shapes[prefix] = (X.shape, B, D)
    mean_fmt = FLOAT_FORMATS["fp32" if s.basis_fmt == "fp32" else "fp16"]
    # the stored means (what encode subtracts), made here on the caller's stream: the caller's
    # gather uses them before it waits for the fit stream
    mean_st = {prefix: means[prefix].reshape(-1, B, D).to(mean_fmt) for prefix, (_, B, D) in shapes.items()}
    G_all = torch.cat(grams) if len(grams) > 1 else grams[0]
    del grams
    with on_side_stream(clock.dev) as st:
        if st is not None:
            G_all.record_stream(st)
        evals_all, U_all = eigh_desc(G_all)
        clock.lap("fit: gram + eigh")
    return Solved(sides, shapes, mean_st, evals_all, U_all)


def fit_launch(solved: Solved, s: CodecSettings, clock: StageClock, sets: list[torch.Tensor],
               overhead_bytes: int | None = None, regenerator=None, layer_weights=None) -> dict[str, Fitted]:
    """Queue, on the fit stream after the eigendecompositions, the bit allocations (over the whole
    state for ``budget="state"`` settings, :mod:`.state_bits`, its costs exact for the parts ``sets``;
    else per layer and side), the stored bases and their quantization. Nothing here waits for the
    device, except with a ``regenerator`` (:mod:`.batched_regen`: each layer side's choice between its
    basis and the document's is made on the host)."""
    out, at, evals = {}, 0, {}
    with on_side_stream(clock.dev) as st:
        for prefix in solved.sides:
            (L, H, T, d), B, D = solved.shapes[prefix]
            evals[prefix] = solved.evals[at:at + L * B].clamp_min(0).float()
            at += L * B
        if state_budgeted(s):
            (L, H, T, d), B, D = solved.shapes["k"]
            all_bits = allocate_state({p: e.reshape(L, B, D) for p, e in evals.items()}, s, H, d, sets, overhead_bytes,
                                      layer_weights)
        at = 0
        for prefix, (X, bpe) in solved.sides.items():
            (L, H, T, d), B, D = solved.shapes[prefix]
            ev = evals[prefix]
            U = solved.U[at:at + L * B].float()
            at += L * B
            mean_st, U, regen = solved.mean_st[prefix], U.view(L, B, D, D), None
            if state_budgeted(s):
                bits = all_bits[prefix]
            else:
                budget = layer_budget_bits(bpe, H, T, d, B, D, s)
                bits = allocate_bits_batched(ev.reshape(L, B, D), [budget] * L, T, D, s)   # [L, B, D]
            if regenerator is not None:
                picked = choose(prefix, X, ev.reshape(L, B, D), U, mean_st, bits, regenerator, s, sets)
                bits, U, mean_st, regen = picked.bits, picked.U, picked.mean_st, picked.regen
            ok = torch.isfinite(ev).all(dim=1).reshape(L, B)
            row_bits, rows = stored_basis(U, bits)
            if regen is None:
                basis, stored = quantize_basis(rows, row_bits, s)
            else:   # the regenerator's columns are not stored: coded on as they are (fp32)
                basis, stored = quantize_basis(rows, torch.where(regen[:, None], 0, row_bits), s)
                basis = torch.where(regen[:, None, None, None], rows, basis)
            out[prefix] = f = Fitted((L, H, T, d), B, D, mean_st, bits, ok, row_bits, basis, stored, regen)
            if st is not None:   # made on the fit stream, used on the caller's after join_side_stream
                main = torch.cuda.current_stream(clock.dev)
                for t in [f.bits, f.solved, f.row_bits, f.basis, f.mean_st] + [v for v in stored.values() if torch.is_tensor(v)]:
                    t.record_stream(main)
        clock.lap("fit: bits + basis")
    return out


def joint_gram_fused(X: torch.Tensor, center: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """centered_gram of the joint-head blocks of X [L, H, T, d] (fp32, CUDA) with the head
    interleave and the centering in one pass (a permuted copy, then a centered one, before)."""
    L, H, T, d = X.shape
    mean = X.mean(dim=2) if center else X.new_zeros(L, H, d)                      # [L, H, d]
    Xc = torch.empty(L, T, H, d, dtype=X.dtype, device=X.device)
    torch.sub(X.permute(0, 2, 1, 3), mean[:, None], out=Xc)
    Xc = Xc.view(L, T, H * d)
    return mean.reshape(L, H * d), Xc.transpose(1, 2) @ Xc / max(1, T)
