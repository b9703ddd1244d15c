"""The batched encoder on a regenerator's bases: per layer and side, the regenerator's basis (``rpca``,
none stored) or the document's own (``pca``), chosen as the per-layer codec chooses them
(:func:`kite.upcycle.codec.layer.fit_state` with a regenerator, ``choice="expected"``): each layer
side gets the bits the state-wide allocation gave it on the document's basis as its budget, both
candidates are allocated within it, and the one expected to leave less squared error is kept (a
tie goes to the regenerator: no basis stored).

The candidates' allocations are the per-layer codec's own calls (:func:`.bits.allocate_bits` on the
same variances), so on the CPU the bytes are the per-layer codec's. Taken: an unweighted regenerator
choosing by the expected error, with a state-wide budget (:func:`takes`); a weighted one, or one that
chooses by measured error or the attention probe, goes through the per-layer codec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kite.errors import KiteError
from kite.upcycle.codec.bits import SideBudget, allocate_bits, allocation_cost, expected_error
from kite.upcycle.codec.coders import blocks
from kite.upcycle.codec.layer import state_budgeted
from kite.upcycle.codec.settings import CodecSettings
from kite.upcycle.codec.state_bits import basis_header_bits

__all__ = ["RegenSides", "choose", "takes"]


def takes(regenerator, settings: CodecSettings) -> bool:
    """Whether the batched encoder codes on this regenerator (else the per-layer codec does)."""
    return (not regenerator.weighted and regenerator.choice in (None, "expected")
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
           state_bits: torch.Tensor, regenerator, s: CodecSettings, sets: list[torch.Tensor]) -> RegenSides:
    """Per layer of one side (X [L, H, T, d] float32; the document's PCA: ``evals`` [L, B, D], ``U``
    [L, B, D, D], ``mean_st`` [L, B, D]; ``state_bits`` [L, B, D] the state-wide allocation on it):
    the candidate the per-layer codec keeps."""
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
