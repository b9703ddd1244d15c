"""Names of the blobs in a `.upc` state: one shared codec per layer, one K and one V part per
(cluster, layer)."""

from __future__ import annotations


def blob_key(cluster: int | None, layer: int, side: str | None = None) -> str:
    """'L3' (layer 3's shared codec), 'c2/L3/K', 'c2/L3/V' (cluster 2's keys / values of layer 3)."""
    return f"L{layer}" if cluster is None else f"c{cluster}/L{layer}/{side}"


def layer_keys(layer: int, clusters) -> list[str]:
    """The blobs one layer of a load reads, in file order: its shared codec, then each cluster's K, V."""
    return [blob_key(None, layer)] + [blob_key(c, layer, side) for c in clusters for side in ("K", "V")]
