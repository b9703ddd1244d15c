"""Names of the blobs in a `.upc` state: one shared codec per layer, one K and one V part per
(cluster, layer); a state coded on bases across layers (its header's ``layer_groups``) has them
per group of layers instead, under the group's first layer."""

from __future__ import annotations

from kite.errors import BadInput


def blob_key(cluster: int | None, layer: int, side: str | None = None) -> str:
    """'L3' (layer 3's shared codec), 'c2/L3/K', 'c2/L3/V' (cluster 2's keys / values of layer 3)."""
    return f"L{layer}" if cluster is None else f"c{cluster}/L{layer}/{side}"


def layer_keys(layer: int, clusters) -> list[str]:
    """The blobs one layer of a load reads, in file order: its shared codec, then each cluster's K, V."""
    return [blob_key(None, layer)] + [blob_key(c, layer, side) for c in clusters for side in ("K", "V")]


def groups_of(meta: dict, n_layers: int) -> list[tuple[int, int]]:
    """[start, stop) of each group of layers a state's (or regenerator's) header lists, one per
    layer when it lists none. BadInput when the list does not cover 0..n_layers in order."""
    raw = meta.get("layer_groups")
    if raw is None:
        return [(layer, layer + 1) for layer in range(n_layers)]
    at, out = 0, []
    for g in raw if isinstance(raw, list) else [raw]:
        if not (isinstance(g, list) and len(g) == 2 and all(type(x) is int for x in g) and g[0] == at < g[1]):
            raise BadInput(f"layer_groups {str(raw)[:80]} is not a list of [start, stop] groups covering layers "
                           f"0-{n_layers - 1} in order")
        out.append((g[0], g[1]))
        at = g[1]
    if at != n_layers:
        raise BadInput(f"layer_groups {str(raw)[:80]} does not cover the state's {n_layers} layers")
    return out


def group_of(groups: list[tuple[int, int]], layer: int) -> tuple[int, int]:
    """The group a layer belongs to."""
    return next(g for g in groups if g[0] <= layer < g[1])


def group_leads(meta: dict, n_layers: int) -> list[int]:
    """The layers a state's blobs are stored under: every layer, or each group's first."""
    return [a for a, _ in groups_of(meta, n_layers)]
