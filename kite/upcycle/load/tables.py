"""The staged layout of a load: one region per layer (its blobs, then small aligned tables), the
tables' plans, and the tables kept across processes.

A staging builds, per layer and side, the tables the rebuild kernels read (each part's row range and
code offsets, the means as float32, the sink rows). Building them is most of a first load's host
work; reading them back from ``KITE_CACHE/upc_tables`` is a small fraction of it. They are kept for
the identical file version, header checksum, selection and geometry, next to the verified-blob
records and under the same trust rules, and checked against the layout a new staging computes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from kite.atomic import write_bytes
from kite.paths import cache_dir

ALIGN = 256


def round_up(n: int, a: int = 16) -> int:
    return (n + a - 1) // a * a


@dataclass
class SidePlan:
    """One side's (K or V) tables in a staged layer region: offsets from the region's start, and the
    small tables the torch fallbacks read on the host."""

    R: int
    B: int
    D: int
    blk_off: list[int]
    mean: int                   # float32 [H*d] (table offset in the region)
    basis_kind: str             # "int" | "float" | "regen"
    basis: tuple                # int: (tab, bits, bitoff, goff) offsets; float: (off, dtype, D, R);
                                # regen (a layer group's): (int64 [R] column indices, R)
    parts_tab: int              # int64 [P, 6]
    parts_tab_host: list
    col_bits: int               # uint8 [R]
    col_bitoff: int             # int64 [P, R]
    col_goff: int               # int64 [P, R]
    max_T: int
    n_ovr: int
    ovr: int                    # int64 [n_ovr, 4]
    ovr_host: list


@dataclass
class LayerPlan:
    """One staged layer: its region in the staged buffer and both sides' tables."""

    off: int                    # region start in the staged buffer
    size: int
    sides: dict[str, SidePlan]
    times_ms: dict[str, float] = field(default_factory=dict)   # read / verify / tables (this layer)


def table_bound(H: int, d: int, P: int, s: dict, regenerated: bool = False) -> int:
    """Bytes the tables of one layer may take (both sides), from the codec settings (``regenerated``:
    the state takes some bases from a regenerator, copied into the tables as float32)."""
    HD = H * d
    D = HD if s.get("joint_heads") else d
    basis_float = 0 if str(s.get("basis_fmt", "int8")).startswith("int") and not regenerated else D * HD * 4 + 16
    n_ovr = int(s.get("sink_tokens", 1)) + P * int(s.get("outliers", 0))
    # mean, column widths, basis table + widths + offsets, parts table, column offsets, sinks
    per_side = 4 * HD + HD + (48 + 17 * HD) + basis_float + 48 * P + 16 * P * HD + 32 * n_ovr + 16 * 12
    return 2 * per_side + 64


TABLES_MAGIC = b"KITETBL1"   # bump the digit when stage_layer's tables or SidePlan change meaning
TABLES_KEPT = 64


def tables_dir():
    """Where the kept tables live (one ``.tbl`` file per file path + selection + geometry)."""
    return cache_dir() / "upc_tables"


def tables_file(ckey: tuple):
    """One file per (file path, selection, layers, H, d); its name starts with the path's hash."""
    version, clusters, layers, H, d = ckey
    path_h = hashlib.sha256(version[0].encode()).hexdigest()[:16]
    sel_h = hashlib.sha256(json.dumps([list(clusters), list(layers), H, d]).encode()).hexdigest()[:16]
    return tables_dir() / f"{path_h}-{sel_h}.tbl"


def save_tables(ckey: tuple, header_sum: str, layers: dict[int, tuple[LayerPlan, np.ndarray]]) -> None:
    """Keep a staging's tables. Best effort: a cache that cannot be written only costs building the
    tables again."""
    items = sorted(layers.items())
    head, at = [], 0
    for layer, (plan, tbytes) in items:
        head.append({"layer": layer, "off": plan.off, "size": plan.size, "at": at, "n": int(tbytes.size),
                     "sides": {k: dataclasses.asdict(sp) for k, sp in plan.sides.items()}})
        at += int(tbytes.size)
    meta = json.dumps({"version": list(ckey[0]), "header": header_sum, "key": [list(ckey[1]), list(ckey[2]),
                                                                               ckey[3], ckey[4]],
                       "layers": head}, separators=(",", ":")).encode()
    try:
        target = tables_file(ckey)
        write_bytes(target, b"".join([TABLES_MAGIC, struct.pack("<I", len(meta)), meta]
                                     + [tbytes.tobytes() for _, (_, tbytes) in items]))
        kept = sorted(tables_dir().glob("*.tbl"), key=lambda f: f.stat().st_mtime_ns)
        for old in kept[:-TABLES_KEPT]:
            old.unlink(missing_ok=True)
    except OSError:
        pass


def load_tables(ckey: tuple, header_sum: str) -> dict[int, tuple[LayerPlan, np.ndarray]] | None:
    """The tables saved for exactly this file version, header, selection and geometry (else None)."""
    try:
        data = tables_file(ckey).read_bytes()
        if data[:8] != TABLES_MAGIC:
            return None
        (n,) = struct.unpack("<I", data[8:12])
        meta = json.loads(data[12:12 + n])
        if (meta.get("version") != list(ckey[0]) or meta.get("header") != header_sum
                or meta.get("key") != [list(ckey[1]), list(ckey[2]), ckey[3], ckey[4]]):
            return None
        body = memoryview(data)[12 + n:]
        out = {}
        for e in meta["layers"]:
            sides = {k: SidePlan(**{**sp, "basis": tuple(sp["basis"])}) for k, sp in e["sides"].items()}
            tbytes = np.frombuffer(body[e["at"]:e["at"] + e["n"]], dtype=np.uint8)
            if tbytes.size != e["n"]:
                return None
            out[int(e["layer"])] = (LayerPlan(off=e["off"], size=e["size"], sides=sides), tbytes)
        return out
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def forget_tables(path=None) -> None:
    """Drop the kept tables of one file (or all)."""
    try:
        if path is None:
            files = list(tables_dir().glob("*.tbl"))
        else:
            path_h = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:16]
            files = list(tables_dir().glob(f"{path_h}-*.tbl"))
        for f in files:
            f.unlink(missing_ok=True)
    except OSError:
        pass
