"""Which parts of a state one load reads: the chosen clusters whole, plus the attention sinks.

A partial load always brings the document's first tokens along: they are attention sinks (most of
the attention mass lands on them), and without them a cluster loaded alone made the model worse than
no state at all in the bench (docs/PERFORMANCE.md, "Bench").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kite.errors import BadInput
from kite.upcycle.format.container import StateFile

SINK_TOKENS = 4


@dataclass
class Selection:
    """The parts a load reads, in read order: each chosen cluster whole, then every other cluster
    that holds sink tokens with a mask of those (``keep``)."""

    chosen: list[int]                                  # cluster ids chosen, ascending
    labels: list[str]                                  # their labels
    parts: list[tuple[int, torch.Tensor | None]]       # (cluster, keep mask over its tokens or None = all)
    part_positions: list[torch.Tensor]                 # each part's tokens' positions (all, ascending)

    @property
    def sink_tokens(self) -> int:
        """Tokens that come along only as attention sinks."""
        return sum(int(keep.sum()) for _, keep in self.parts if keep is not None)

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions of the kept tokens in read order, the order that sorts them)."""
        pos = [p if keep is None else p[keep] for (_, keep), p in zip(self.parts, self.part_positions)]
        positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)
        return positions, torch.argsort(positions)


def select_clusters(state: StateFile, wanted: list[str] | None) -> list[int]:
    """Cluster ids for labels or ids in `wanted` (None = all). Unknown names and an empty list
    (which would load nothing, or everything) are BadInput."""
    clusters = state.meta["clusters"]
    if wanted is None:
        return [c["id"] for c in clusters]
    if not wanted:
        raise BadInput("--clusters: no cluster named (give labels or ids, or leave --clusters out to load all)")
    chosen: list[int] = []
    labels = sorted({c["label"] for c in clusters})
    for name in wanted:
        hits = [c["id"] for c in clusters if c["label"] == name or str(c["id"]) == name]
        if not hits:
            raise BadInput(f"--clusters {name}: not in this state (labels: {', '.join(labels)}; "
                           f"or cluster ids 0-{len(clusters) - 1})")
        chosen.extend(h for h in hits if h not in chosen)
    return sorted(chosen)


def cluster_positions(state: StateFile, cluster: int) -> torch.Tensor:
    """The document positions of a cluster's tokens, ascending."""
    ranges = next(c["token_ranges"] for c in state.meta["clusters"] if c["id"] == cluster)
    return torch.cat([torch.arange(s, e) for s, e in ranges]) if ranges else torch.zeros(0, dtype=torch.long)


def select(state: StateFile, wanted: list[str] | None, sink_tokens: int = SINK_TOKENS) -> Selection:
    """The parts a load of ``wanted`` (labels or ids; None = every cluster) reads. When only some
    clusters are chosen, the document's first ``sink_tokens`` tokens come too."""
    chosen = select_clusters(state, wanted)
    info = {c["id"]: c for c in state.meta["clusters"]}
    parts: list[tuple[int, torch.Tensor | None]] = [(c, None) for c in chosen]
    positions = {c: cluster_positions(state, c) for c in info}
    if chosen and sink_tokens > 0:
        for c in sorted(set(info) - set(chosen)):
            keep = positions[c] < sink_tokens
            if keep.any():
                parts.append((c, keep))
    return Selection(chosen=chosen, labels=[info[c]["label"] for c in chosen], parts=parts,
                     part_positions=[positions[c] for c, _ in parts])
