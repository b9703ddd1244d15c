"""Entropy coding of a state's quantized coefficients: the codec's last stage (opt-in).

A part of a PCA-coded side (``pca``, or ``rpca`` on a regenerator's basis) stores its coefficients
as fixed-width codes, one run per bit class (kite.upcycle.format.bitlayout). The classes follow from
the layer codec (its side's bit table, or the part's own widths) and the part's token count, so
:func:`part_runs` finds each run's width and bytes from the two blobs alone, and :func:`entropy_code`
stores every part whose runs it finds with its codes entropy coded (the container's ``rans`` blob
codec, kite.upcycle.format.entropy_blob), the other blobs as they are. A reader gets the plain
blobs back (``StateFile.inflate``).

At a ratio the state-wide budget counts every byte as coded before this stage, so a state coded
this way comes out smaller than asked; :mod:`kite.upcycle.compress` gives the allocation the bytes
the coding saved and codes again until the file is the size asked (docs/compression.md).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable

import numpy as np

from kite.upcycle.codec.state_bits import within_budget
from kite.upcycle.format import codec_blob, entropy_blob, rans
from kite.upcycle.format.bitlayout import class_layout

CODED_MODES = ("pca", "rpca")
_PART = re.compile(r"^c(\d+)/L(\d+)/([KV])$")


def part_runs(layer_blob: bytes, part_blob: bytes, side: str,
              layer_table: tuple | None = None) -> tuple[tuple[int, int], list[tuple[int, int]]] | None:
    """Where a part's codes lie in its blob and their runs: ((offset, length), [(bw, nbytes), ...]);
    None where the side is not PCA-coded or the part has no codes. ``layer_table``: the layer blob's
    ``codec_blob.read_table`` when the caller has it (a layer's parts read it once)."""
    lmeta, ltable, _ = layer_table or codec_blob.read_table(layer_blob)
    if (lmeta.get(side) or {}).get("mode") not in CODED_MODES:
        return None
    pmeta, ptable, _ = codec_blob.read_table(part_blob)
    codes = next(((off, math.prod(shape)) for name, dt, shape, off in ptable if name == "codes" and dt == "u8"), None)
    if codes is None:
        return None
    own = pmeta.get("bits")
    if own is not None:
        widths = np.asarray(own, dtype=np.int64)
    else:
        spec = next(((off, shape) for name, dt, shape, off in ltable if name == f"{side}.bits" and dt == "u8"), None)
        if spec is None:
            return None
        off, shape = spec
        bits = np.frombuffer(layer_blob, dtype=np.uint8, count=math.prod(shape), offset=off).astype(np.int64)
        widths = bits[bits > 0]
    s = lmeta.get("settings") or {}
    T = int(pmeta.get("T", 0))
    runs = []
    for bw in sorted(set(widths.tolist()) - {0}):
        _, nbytes, _ = class_layout(T, int((widths == bw).sum()), bw, int(s.get("group_size", 128)),
                                    bool(s.get("even_groups", False)))
        runs.append((int(bw), nbytes))
    if not runs or sum(n for _, n in runs) != codes[1]:
        return None
    return codes, runs


def entropy_code(items: list[tuple[str, bytes]]) -> tuple[list[tuple[str, bytes, int, str]], dict | None]:
    """Every blob of a state as the container stores it: (key, stored bytes, plain length, codec),
    each part whose codes :func:`part_runs` finds entropy coded where that makes it smaller
    (``rans``), every other blob as it is (``raw``); and the header's ``entropy`` section (one table
    per width, made from every coded part's codes; None when no part is coded). A part's layer
    codec is the blob of its layer (of its group's first layer, for a state coded on bases across
    layers), earlier in ``items``."""
    layers: dict[int, tuple[bytes, tuple]] = {}     # layer -> its blob and its parsed table
    found: dict[str, tuple] = {}                     # part -> (where its codes lie, its runs, its codes)
    counts: dict[int, np.ndarray] = {}
    for key, data in items:
        m = _PART.match(key)
        if m is None:
            if key.startswith("L") and key[1:].isdigit():
                layers[int(key[1:])] = (data, codec_blob.read_table(data))
            continue
        layer, side = int(m.group(2)), m.group(3).lower()
        where = part_runs(layers[layer][0], data, side, layers[layer][1]) if layer in layers else None
        codes = entropy_blob.run_codes(data, *where) if where is not None else None
        if codes is None:
            continue
        found[key] = (*where, codes)
        for (bw, _), c in zip(where[1], codes):
            counts[bw] = counts.get(bw, 0) + np.bincount(c, minlength=1 << bw)
    tables = {bw: rans.quantize_frequencies(c) for bw, c in counts.items()}
    out = []
    for key, data in items:
        stored = entropy_blob.pack(data, *found[key], tables) if key in found else None
        out.append((key, stored, len(data), entropy_blob.CODEC) if stored is not None else (key, data, len(data), "raw"))
    coded = any(how == entropy_blob.CODEC for *_, how in out)
    return out, entropy_blob.tables_json(tables) if coded else None


def coded_within(code: Callable[[int], list[tuple[str, bytes]]],
                 budget: Callable[[], float] | None) -> tuple[list, dict | None, float]:
    """``entropy_code(code(bonus))``: the blobs ``code`` makes with ``bonus`` bytes beyond the state's
    budget, entropy coded. With ``budget`` (called after the first coding: the bytes the blobs may
    take at the state's ratio), the bytes a coding saved go back into the next one's allocation
    (:func:`.state_bits.within_budget`). Returns the stored blobs, the header's ``entropy`` section
    and the ms spent entropy coding (the passes' own coding time is the caller's)."""
    spent = 0.0

    def one(bonus: int) -> tuple[list, dict | None]:
        nonlocal spent
        items = code(bonus)
        t = time.perf_counter()
        out = entropy_code(items)
        spent += (time.perf_counter() - t) * 1e3
        return out

    stored, tables = within_budget(one, lambda out: sum(len(d) for _, d, _, _ in out[0]), budget)
    return stored, tables, spent


__all__ = ["CODED_MODES", "coded_within", "entropy_code", "part_runs"]
