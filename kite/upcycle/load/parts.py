"""A state's parts read for decoding: each layer codec and part checked against its layer, its
cluster and the geometry (:mod:`kite.upcycle.codec.checks`) before a decoder sees it, and
:func:`check_parts`, the same checks over a whole state (``kite upcycle inspect --verify``)."""

from __future__ import annotations

from kite.errors import BadInput
from kite.upcycle import codec
from kite.upcycle.codec.checks import check_layer, check_part, table_of
from kite.upcycle.format.container import StateFile
from kite.upcycle.codec.groups import group_geometry
from kite.upcycle.format.names import blob_key, groups_of


def _bad_part(state: StateFile, key: str, exc: BaseException) -> BadInput:
    return BadInput(f"{state.path}: part {key} does not decode ({exc})")


def read_layer(state: StateFile, layer: int, verify: bool, H: int, d: int):
    """A layer codec read and checked (:func:`kite.upcycle.codec.checks.check_layer`): (codec, widths)."""
    key = blob_key(None, layer)
    data = state.read(key, verify=verify)
    try:
        lc = codec.from_bytes(data, codec.LayerCodec)
        bits = {side: lc.tensors[f"{side}.bits"].numpy() for side in ("k", "v") if f"{side}.bits" in lc.tensors}
        widths = check_layer(lc.meta, table_of(lc.tensors), bits, H, d)
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad_part(state, key, exc) from None
    return lc, widths


def read_part(state: StateFile, key: str, verify: bool, lc, widths: dict, tokens: int, H: int, d: int):
    """A part's blob read and checked against its layer codec and its cluster's ``tokens``."""
    data = state.read(key, verify=verify)
    side = key.rsplit("/", 1)[1].lower()
    try:
        blob = codec.from_bytes(data)
        idx = blob.tensors.get("out.idx")
        check_part(lc.meta, side, widths.get(side), blob.meta, table_of(blob.tensors), tokens, H, d,
                   outliers=None if idx is None or idx.dim() != 1 else idx.numpy())
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad_part(state, key, exc) from None
    return blob


def decode_part(state: StateFile, lc, part, cluster: int, layer: int):
    """A checked part decoded; should the decoder still refuse it, a BadInput naming the part."""
    try:
        return codec.decode(lc, part)
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
        raise _bad_part(state, f"c{cluster}/L{layer}", exc) from None


def check_parts(state: StateFile, verify: bool = True) -> dict[str, str]:
    """Every layer (or group) codec and part of ``state`` read and checked as a load checks them, without
    decoding: {key: what is wrong} for those that fail (a part of a layer whose codec fails is not
    checked)."""
    geo = state.meta["model"]["geometry"]
    H, d = int(geo["n_kv_heads"]), int(geo["head_dim"])
    tokens = {c["id"]: c["n_tokens"] for c in state.meta["clusters"]}
    failed: dict[str, str] = {}
    for a, b in groups_of(state.meta, int(geo["n_layers"])):
        layer = a
        H, d = group_geometry((a, b), int(geo["n_kv_heads"]), int(geo["head_dim"])) if b - a > 1 else (H, d)
        try:
            lc, widths = read_layer(state, layer, verify, H, d)
        except BadInput as exc:
            failed[blob_key(None, layer)] = str(exc).split(": ", 1)[-1]
            continue
        for c, n in tokens.items():
            for side in ("K", "V"):
                try:
                    read_part(state, blob_key(c, layer, side), verify, lc, widths, n, H, d)
                except BadInput as exc:
                    failed[blob_key(c, layer, side)] = str(exc).split(": ", 1)[-1]
    return failed
