"""The batched encoder on a regenerator's bases: per layer and side, the regenerator's basis (``rpca``,
none stored) or the document's own (``pca``), chosen as the per-layer codec chooses them
(:func:`kite.upcycle.codec.layer.fit_state` with a regenerator, ``choice="expected"``): each layer
side gets the bits the state-wide allocation gave it on the document's basis as its budget, both
candidates are allocated within it, and the one expected to leave less squared error is kept (a
tie goes to the regenerator: no basis stored).

On the CPU the candidates' allocations are the per-layer codec's own calls (:func:`.bits.allocate_bits`
on the same variances), so the bytes are the per-layer codec's. On a GPU every layer's candidates are
allocated at once on the device (:func:`.bits.allocate_bits_batched`: the same greedy order, ties
aside) and chosen there, with no wait for the host: layer by layer on the host, a 2K-token state of
the embedded model took ~0.4 s on an H200, most of a training run's coding. Taken: an unweighted regenerator
choosing by the expected error, with a state-wide budget (:func:`takes`); a weighted one, or one that
chooses by measured error or the attention probe, goes through the per-layer codec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kite.errors import KiteError
from kite.upcycle.codec.bits import (SideBudget, allocate_bits, allocate_bits_batched, allocation_cost,
                                     allocation_costs, expected_error, expected_errors)
from kite.upcycle.codec.coders import blocks
from kite.upcycle.codec.layer import state_budgeted
from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.codec.state_bits import basis_header_bits

__all__ = ["RegenSides", "choose", "takes"]


def takes(regenerator, settings: CodecSettings) -> bool:
    """Whether the batched encoder codes on this regenerator (else the per-layer codec does)."""
    return (not regenerator.weighted and not regenerator.grouped and regenerator.choice in (None, "expected")
            and state_budgeted(settings))


@dataclass
class RegenSides:
    """One side's choice, every layer: the bits, the basis coded on (columns = components), the mean
    as stored, and which layers took the regenerator's basis."""

    bits: torch.Tensor        # [L, B, D] int64
    U: torch.Tensor           # [L, B, D, D] float32
    mean_st: torch.Tensor     # [L, B, D] the stored means
    regen: torch.Tensor       # [L] bool


def choose(side: str, X: torch.Tensor, evals: torch.Tensor, U: torch.Tensor, mean_st: torch.Tensor,
           state_bits: torch.Tensor, regenerator, s: CodecSettings, sets: list[torch.Tensor],
           batched: bool | None = None) -> RegenSides:
    """Per layer of one side (X [L, H, T, d] float32; the document's PCA: ``evals`` [L, B, D], ``U``
    [L, B, D, D], ``mean_st`` [L, B, D]; ``state_bits`` [L, B, D] the state-wide allocation on it):
    the candidate the per-layer codec keeps. ``batched``: every layer at once on X's device
    (default: on a GPU), else layer by layer with the host's allocation."""
    if batched if batched is not None else X.is_cuda:
        return _choose_batched(side, X, evals, U, mean_st, state_bits, regenerator, s, sets)
    L, H, T, d = X.shape
    B, D = evals.shape[1:]
    parts = tuple(int(t.numel()) for t in sets if t.numel())
    header = basis_header_bits(s, H, d, B, D)
    bits, bases, means, regen = [], [], [], []
    for layer in range(L):
        budget = SideBudget(allocation_cost(state_bits[layer], T, D, s, parts), parts)
        # the document's basis (PcaSide.fit within the budget)
        ev = evals[layer].cpu()
        if not bool(torch.isfinite(ev).all()):
            raise KiteError(f"the eigensolver did not converge on the {side} Gram of layer(s) [{layer}] "
                            "(non-finite KV values?)")
        doc_bits = allocate_bits(ev, budget.bits, T, D, s, parts=budget.parts)
        doc_err = expected_error(ev, doc_bits, s)
        # the regenerator's (RegenSide.fit: its basis's header rows are free, no basis column to pay for)
        Xb = blocks(X[layer], s.joint_heads)                                   # [B, T, D]
        mean = Xb.mean(dim=1) if s.center else Xb.new_zeros(B, D)
        Ur = regenerator.side(layer, side)[2].to(Xb.device, torch.float32)
        variances = torch.matmul(Xb - mean[:, None, :], Ur).pow(2).mean(dim=1).cpu()
        reg_bits = allocate_bits(variances, budget.bits + header, T, D, s, basis_stored=False, parts=budget.parts)
        if expected_error(variances, reg_bits, s) <= doc_err:
            bits.append(reg_bits)
            bases.append(Ur)
            means.append(mean.to(mean_st.dtype))
            regen.append(True)
        else:
            bits.append(doc_bits)
            bases.append(U[layer].float())
            means.append(mean_st[layer])
            regen.append(False)
    dev = X.device
    return RegenSides(torch.stack(bits).to(dev), torch.stack(bases), torch.stack(means),
                      torch.tensor(regen, device=dev))


def _choose_batched(side: str, X: torch.Tensor, evals: torch.Tensor, U: torch.Tensor, mean_st: torch.Tensor,
                    state_bits: torch.Tensor, regenerator, s: CodecSettings, sets: list[torch.Tensor]) -> RegenSides:
    """:func:`choose` for every layer at once on X's device. A non-finite eigenvalue is not checked
    here: the encoder stops on it (``Fitted.solved``) after the fit."""
    L, H, T, d = X.shape
    B, D = evals.shape[1:]
    dev = X.device
    parts = tuple(int(t.numel()) for t in sets if t.numel())
    # each layer side's budget: what the state-wide allocation spent on it
    budgets = allocation_costs(state_bits, T, D, s, parts)
    ev = evals.float()
    doc_bits = allocate_bits_batched(ev, budgets, T, D, s, parts=parts)
    doc_err = expected_errors(ev, doc_bits, s)
    # the regenerator's basis: the document's variances along it; its header rows are free
    Xb = X.permute(0, 2, 1, 3).reshape(L, 1, T, H * d) if s.joint_heads else X             # [L, B, T, D]
    mean = Xb.mean(dim=2) if s.center else Xb.new_zeros(L, B, D)
    Ur = regenerator.bases(side, dev)                                                     # [L, B, D, D]
    variances = torch.matmul(Xb - mean[:, :, None, :], Ur).pow(2).mean(dim=2)             # [L, B, D]
    reg_bits = allocate_bits_batched(variances, budgets + basis_header_bits(s, H, d, B, D), T, D, s,
                                     basis_stored=False, parts=parts)
    regen = expected_errors(variances, reg_bits, s) <= doc_err                            # a tie: no basis stored
    return RegenSides(torch.where(regen[:, None, None], reg_bits, doc_bits),
                      torch.where(regen[:, None, None, None], Ur, U.float()),
                      torch.where(regen[:, None, None], mean.to(mean_st.dtype), mean_st), regen)
