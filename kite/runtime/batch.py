"""Right-padded batches of token sequences, the shape every batched forward here takes, and which
sequences go into one forward."""

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


# Padded tokens one forward of several sequences may hold, by device type (:func:`forward_groups`).
# A device not named here runs one sequence a forward: a CPU pays for every token's products,
# padding included, where a GPU's forward of a 2K-token document is bound by the host's launches.
BATCH_TOKENS = {"cuda": 16384}


def forward_groups(lengths: Sequence[int], device) -> list[list[int]]:
    """Consecutive sequences (their indices) that one forward takes together on ``device``: as many
    as keep the group's count times its longest within ``BATCH_TOKENS``, one at a time where the
    device has no budget."""
    budget = BATCH_TOKENS.get(torch.device(device).type, 0)
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= budget:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups
