"""Where the codes of a PCA-coded part lie: the bit-class layout, written once for every reader and writer.

A part holds the coefficients of ``T`` tokens on ``R`` columns (principal components), column j
at its own bit width ``col_bits[j]`` (1..8). Tokens are cut into groups of ``gs`` (the codec's
``group_size``, or ``T`` when that is larger or <= 0; with ``even_groups``, ceil(T / group_size)
groups of equal size); a column's tokens are padded to whole groups (``padded`` = ceil(T / gs) * gs) with copies of its last token. Columns of one width form a
*class*; classes follow in ascending width, and within a class the columns keep their order. Each
class's codes are one run of ``ncols * padded`` codes, LSB-first, starting on a byte; each group
has one fp16 scale and one fp16 minimum, in the same (class, column, group) order.

The same layout is computed three ways, for three callers, and tested against each other:
:func:`class_layout` (one class: its QTensor meta, for the per-layer codec's decode),
:func:`parts_layout` (every column of many parts at once, numpy: the GPU staging's tables) and
:func:`runs_plan` (every (layer, part, width) run of a whole state on the device, no host sync:
the batched encoder writes its codes there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_WIDTH = 8


def group_shape(T: int, group_size: int, even: bool = False) -> tuple[int, int]:
    """(gs, padded): the group size a part of T tokens uses and its tokens padded to whole groups.
    ``even`` (the codec's ``even_groups``): ceil(T / group_size) groups of equal size, so a part pads
    fewer tokens than it has groups; else groups of ``group_size``, the last padded up to it."""
    if group_size <= 0 or group_size >= T:
        gs = T
    elif even:
        gs = -(-T // -(-T // group_size))
    else:
        gs = group_size
    return gs, (-(-T // gs) * gs if T else 0)


def class_layout(T: int, ncols: int, bw: int, group_size: int, even: bool = False) -> tuple[dict, int, int]:
    """One class of a part (``ncols`` columns of width ``bw``): the QTensor meta its codes were
    quantized with, its code bytes and its group count."""
    gs, padded = group_shape(T, group_size, even)
    n = ncols * padded
    groups = n // gs if gs else 0
    meta = {"fmt": f"int{bw}", "shape": [T, ncols], "group_size": gs, "axis": -2, "n": n, "padded_cols": gs}
    return meta, (n * bw + 7) // 8, groups


def parts_layout(col_bits: np.ndarray, Ts: list[int], group_size: int,
                 even: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column offsets of P parts with the same columns: (bitoff [P, R] of each column's first code
    in its part's codes, goff [P, R] of its first group, gs [P]); ``even``: as :func:`group_shape`."""
    Ta = np.asarray(Ts, dtype=np.int64)
    gs = np.maximum(np.array([group_shape(int(t), group_size, even)[0] for t in Ta], dtype=np.int64), 1)
    padded = -(-Ta // gs) * gs
    cb = np.asarray(col_bits, dtype=np.int64)
    widths = np.arange(MAX_WIDTH + 1)
    seen = np.cumsum(cb[None, :] == widths[:, None], axis=1)             # [width, column]: columns so far
    rank = seen[cb, np.arange(cb.size)] - 1                               # among the columns of its width
    codes = seen[:, -1][None, :] * padded[:, None] if cb.size else np.zeros((Ta.size, widths.size), dtype=np.int64)
    run_bytes = (codes * widths + 7) // 8                                # [P, width] each class's run
    byte0 = np.cumsum(run_bytes, axis=1) - run_bytes
    groups = codes // gs[:, None]
    group0 = np.cumsum(groups, axis=1) - groups
    bitoff = byte0[:, cb] * 8 + rank[None, :] * padded[:, None] * cb[None, :]
    goff = group0[:, cb] + rank[None, :] * (padded // gs)[:, None]
    return bitoff, goff, gs


@dataclass
class RunsPlan:
    """Where the codes of rows at their widths go, over L layers and C parts (device tensors).

    Runs (layer, part, width) lie in that order, each a whole number of bytes, so one part's codes
    (all its widths, ascending) are one slice. ``tables`` [4, L, C, W]: each run's first byte,
    bytes, first scale and scales."""

    base_bit: torch.Tensor    # [L*S, C] int64: first bit of row r's codes in part c
    base_sc: torch.Tensor     # [L*S, C] int64: index of row r's first scale in part c
    tables: torch.Tensor      # [4, L, C, W] int64

    def sizes(self, upper: tuple[int, int]) -> tuple[int, int]:
        """(code bytes, scales) of the whole plan: exact on the CPU, ``upper`` on a GPU (no host sync)."""
        if self.tables.is_cuda:
            return upper
        return int(self.tables[1].sum()), int(self.tables[3].sum())


def runs_plan(row_bits: torch.Tensor, ng: torch.Tensor, gs: torch.Tensor, max_bits: int) -> RunsPlan:
    """The plan of rows [L, S] at widths ``row_bits`` (0: not stored) over C parts of ``ng`` groups of
    ``gs`` tokens each (device tensors; no host sync). A row is a column of every part; within a run
    the rows keep their order, each with its part's groups in order."""
    L, S = row_bits.shape
    w = torch.arange(max_bits + 1, device=row_bits.device)
    onehot = (row_bits[..., None] == w).long()                             # [L, S, W]
    rank = ((onehot.cumsum(1) - onehot) * onehot).sum(2)                   # among the layer's rows of its width
    count = onehot.sum(1)                                                  # [L, W]
    per_row = ng * gs                                                      # codes of one row in each part
    nbytes = (count[:, None, :] * per_row[None, :, None] * w + 7) // 8     # [L, C, W]
    nsc = count[:, None, :] * ng[None, :, None] * (w > 0)
    first = nbytes.reshape(-1).cumsum(0).view_as(nbytes) - nbytes
    first_sc = nsc.reshape(-1).cumsum(0).view_as(nsc) - nsc
    at = row_bits[:, :, None].expand(L, S, ng.numel())
    base_bit = first.transpose(1, 2).gather(1, at) * 8 + (rank * row_bits)[..., None] * per_row
    base_sc = first_sc.transpose(1, 2).gather(1, at) + rank[..., None] * ng
    return RunsPlan(base_bit.reshape(L * S, -1), base_sc.reshape(L * S, -1),
                    torch.stack([first, nbytes, first_sc, nsc]))
