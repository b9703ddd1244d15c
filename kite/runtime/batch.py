"""Right-padded batches of token sequences, the shape every batched forward here takes."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def right_padded(seqs: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both [len(seqs), longest] int64: each row's tokens from column 0,
    `pad` and mask 0 after them."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, :len(seq)] = 1
    return ids, mask
