"""Load `.upc` states onto a GPU: page cache -> pinned host tier -> one copy per layer -> kernels.

The CPU path (``load_prefix``) decodes every part with the codec on the host and copies the rebuilt
KV; this one moves the *compressed* bytes and rebuilds on the device:

1. **stage** (:func:`stage_state`): every blob a load needs (the layer's shared codec, then each
   chosen part's K and V) is read from the file (``preadv`` straight into pinned host memory, in a
   thread pool, checksums verified there), laid out one region per layer, followed by small
   aligned tables (each part's row range and bit offsets, the means as float32, the sink rows);
2. **hot tier** (:class:`HotTier`): staged states stay in pinned memory, least recently used out
   first, up to a byte budget; a hit skips step 1 entirely;
3. **load** (:func:`load_staged`): per layer, one host-to-device copy on a copy stream, then per
   side (K, V) four launches: dequantize the basis, dequantize the coefficients of every part
   (``kite.kernels.load.pca_coefs``), one matmul on tensor cores (bf16 on a GPU), and a finish pass
   (``pca_finish``: mean, fp16 sinks, RoPE at each token's position, written into the cache rows),
   pipelined with the next layer's copy.

Checksums are verified once per *file version* (path, device, inode, size, mtime and ctime in ns,
from ``fstat`` of the open file) and the verified blobs are remembered in-process: a later staging
of the unchanged file reads without re-hashing, and reuses the tables (and, on a GPU, the rebuild
graphs and device row map) built the first time for the same clusters and layers. The verified
blobs are also recorded across processes (``kite.upcycle.state_file.record_verified``, in
``KITE_CACHE``; ``StateWriter`` records the file it wrote, whose checksums it computed itself), so a
new process loading an unchanged file does not re-hash it either; a record counts only for the
identical version and header checksum. A file written in place gets a new mtime/ctime and a
replaced one a new inode, so either is verified again; checks are recorded only if the file's
version did not change while they ran, and ``verify=False`` records nothing. The gap is a change
that leaves every one of those fields as it was (a write within the same coarse timestamp tick as
the file's previous change, after it was staged or written, and no change since, or bytes changed
behind the file system's back, e.g. bit rot): such a file is not re-hashed here, while
``StateFile.verify()`` / ``kite upcycle inspect --verify`` still check every blob.
:func:`forget_verified` drops the records (``KITE_VERIFY_RECORD=0``: no cross-process records).
The tables a staging built are kept across processes the same way (``KITE_CACHE/upc_tables``, for
the identical version, header checksum, selection and geometry, and checked against the layout
the new staging computes): building them is most of a first load's host work (~40 ms of Python
for 28 layers on the H200's host), reading them back ~1 ms (0.9 ms for 28 layers on a 2-core
CPU). :func:`prepare_state` stages a file once so its tables are kept; ``compress_document``
calls it on a GPU after writing.

On the CPU the same code runs with torch fallbacks (no pinning, no copy): that is how the tests
compare it with the codec's own decode. Supported: states whose keys and values are PCA-coded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kite.errors import BadInput
from kite.kernels.load import pca_coefs, pca_finish
from kite.upcycle.state_file import (StateFile, file_version, forget_record, record_verified, records_enabled,
                                     same_version, verified_record)

__all__ = ["HotTier", "HotState", "stage_state", "load_staged", "rebuild_layer", "supports_state", "default_tier",
           "forget_verified", "prepare_state"]

_ALIGN = 256
_DT = {"f32": (np.float32, 4), "f16": (np.float16, 2), "bf16": (None, 2), "f8e4m3": (None, 1), "u8": (np.uint8, 1),
       "i16": (np.int16, 2), "i32": (np.int32, 4), "i64": (np.int64, 8)}


def _up(n: int, a: int = 16) -> int:
    return (n + a - 1) // a * a


def supports_state(state: StateFile) -> bool:
    """Whether the GPU path decodes this state (PCA keys and values)."""
    c = state.meta.get("codec") or {}
    return c.get("k_mode") == "pca" and c.get("v_mode") == "pca"


# --------------------------------------------------------------------------------------------
# staged layout


@dataclass
class _SidePlan:
    R: int
    B: int
    D: int
    blk_off: list[int]
    mean: int                   # float32 [H*d] (table offset in the region)
    basis_kind: str             # "int" | "float"
    basis: tuple                # int: (tab, bits, bitoff, goff) offsets; float: (off, dtype, D, R)
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
class _LayerPlan:
    off: int                    # region start in the staged buffer
    size: int
    sides: dict[str, _SidePlan]
    times_ms: dict[str, float] = field(default_factory=dict)   # read / verify / tables (this layer)


@dataclass
class HotState:
    """A state's chosen blobs in (pinned) host memory, one region per layer, ready to copy."""

    key: tuple
    buffer: torch.Tensor                      # uint8 [nbytes]
    H: int
    d: int
    rows: int                                 # decoded rows per layer (every token of the chosen parts)
    dest: torch.Tensor                        # int64 [rows]: cache row of each decoded row (-1: not kept)
    positions: torch.Tensor                   # int64 [T_out]: the kept tokens' positions, ascending
    layers: list[_LayerPlan | None]
    bytes_read: int = 0
    _futures: list[Future | None] = field(default_factory=list)
    _graphs: dict = field(default_factory=dict)   # rebuild graphs per (buffers) on a GPU
    _dest_dev: dict = field(default_factory=dict)  # device -> (host dest, device copy)
    cached_tables: bool = False                # True when the tables came from the plan cache

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def wait(self, layer: int) -> _LayerPlan | None:
        """The layer's plan once its blobs are staged (re-raises a read error)."""
        if self._futures and self._futures[layer] is not None:
            self.layers[layer] = self._futures[layer].result()
            self._futures[layer] = None
        return self.layers[layer]

    def wait_all(self) -> HotState:
        for layer in range(len(self.layers)):
            self.wait(layer)
        return self


class HotTier:
    """Pinned host memory for hot states: an LRU of staged states within ``capacity_bytes``.

    Buffers of evicted states are kept (up to ``spare`` of them) and reused for the next staging,
    so a miss does not pay for pinning new memory.
    """

    def __init__(self, capacity_bytes: int = 8 << 30, spare: int = 2, pin: bool | None = None):
        self.capacity = int(capacity_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._states: OrderedDict[tuple, HotState] = OrderedDict()
        self._spare: list[torch.Tensor] = []
        self._n_spare = spare
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self._states.values())

    def get(self, key: tuple) -> HotState | None:
        with self._lock:
            hot = self._states.get(key)
            if hot is not None:
                self._states.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return hot

    def put(self, hot: HotState) -> None:
        with self._lock:
            self._states[hot.key] = hot
            self._states.move_to_end(hot.key)
            while len(self._states) > 1 and self.held_bytes > self.capacity:
                _, old = self._states.popitem(last=False)
                self._keep_spare(old.buffer)

    def drop(self, key: tuple) -> None:
        with self._lock:
            old = self._states.pop(key, None)
            if old is not None:
                self._keep_spare(old.buffer)

    def clear(self) -> None:
        with self._lock:
            for old in self._states.values():
                self._keep_spare(old.buffer)
            self._states.clear()

    def _keep_spare(self, buf: torch.Tensor) -> None:
        self._spare.append(buf)
        self._spare.sort(key=lambda b: b.numel())
        while len(self._spare) > self._n_spare:
            self._spare.pop(0)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least nbytes (a spare one when big enough, else newly pinned)."""
        with self._lock:
            for i, b in enumerate(self._spare):
                if b.numel() >= nbytes:
                    return self._spare.pop(i)[:nbytes]
        return torch.empty(_up(nbytes, 2 << 20), dtype=torch.uint8, pin_memory=self.pin)[:nbytes]


_DEFAULT: HotTier | None = None


def default_tier() -> HotTier:
    """The process's hot tier (``KITE_HOT_TIER_GB``, default 8 GB of pinned host memory)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = HotTier(int(float(os.environ.get("KITE_HOT_TIER_GB", "8")) * (1 << 30)))
    return _DEFAULT


# --------------------------------------------------------------------------------------------
# staging


def _parse_blob(buf: memoryview, off: int) -> tuple[dict, dict[str, tuple[int, str, list[int]]]]:
    """A codec blob at buf[off:]: its meta and {tensor: (offset, dtype name, shape)} (offsets absolute)."""
    if buf[off:off + 3] != b"KC1":
        raise BadInput("corrupt .upc state (a part is not a codec blob)")
    n = int.from_bytes(buf[off + 3:off + 7], "little")
    head = json.loads(buf[off + 7:off + 7 + n].tobytes())
    pos = off + 7 + n
    tensors = {}
    for name, dt, shape in head["t"]:
        tensors[name] = (pos, dt, shape)
        pos += math.prod(shape) * _DT[dt][1]
    return head["m"], tensors


def _np_at(view: np.ndarray, spec: tuple[int, str, list[int]]) -> np.ndarray:
    off, dt, shape = spec
    count = math.prod(shape)
    return np.frombuffer(view, dtype=_DT[dt][0], count=count, offset=off).reshape(shape)


def _layouts(colbits: np.ndarray, Ts: list[int], group_size: int):
    """The codec's column layout for several parts at once: bit / group offsets [P, R], each part's gs.

    Per part, the columns' codes lie width by width (ascending), each width's columns in order, a
    column's codes covering the part's padded tokens; every width's run starts on a byte."""
    Ta = np.asarray(Ts, dtype=np.int64)
    gs = np.maximum(np.where((group_size <= 0) | (group_size >= Ta), Ta, group_size), 1)
    padded = -(-Ta // gs) * gs
    cb = np.asarray(colbits, dtype=np.int64)
    seen = np.cumsum(cb[None, :] == np.arange(9)[:, None], axis=1)       # [width, column]: columns so far
    rank = seen[cb, np.arange(cb.size)] - 1                               # among the columns of its width
    codes = seen[:, -1][None, :] * padded[:, None] if cb.size else np.zeros((Ta.size, 9), dtype=np.int64)
    run_bytes = (codes * np.arange(9) + 7) // 8                          # [P, width] each width's run
    byte0 = np.cumsum(run_bytes, axis=1) - run_bytes
    groups = codes // gs[:, None]
    group0 = np.cumsum(groups, axis=1) - groups
    bitoff = byte0[:, cb] * 8 + rank[None, :] * padded[:, None] * cb[None, :]
    goff = group0[:, cb] + rank[None, :] * (padded // gs)[:, None]
    return bitoff, goff, gs


def _table_bound(H: int, d: int, P: int, s: dict) -> int:
    """Bytes the tables of one layer may take (both sides), from the codec settings."""
    HD = H * d
    D = HD if s.get("joint_heads") else d
    basis_float = 0 if str(s.get("basis_fmt", "int8")).startswith("int") else D * HD * 4 + 16
    n_ovr = int(s.get("sink_tokens", 1)) + P * int(s.get("outliers", 0))
    # mean, column widths, basis table + widths + offsets, parts table, column offsets, sinks
    per_side = 4 * HD + HD + (48 + 17 * HD) + basis_float + 48 * P + 16 * P * HD + 32 * n_ovr + 16 * 12
    return 2 * per_side + 64


@dataclass
class _PlanCache:
    layers: dict[int, tuple[_LayerPlan, np.ndarray]] = field(default_factory=dict)   # plan + its table bytes
    graphs: dict = field(default_factory=dict)
    dest_dev: dict = field(default_factory=dict)


def _file_version(fd: int, path) -> tuple:
    """What identifies one version of a file's bytes (see ``state_file.file_version``)."""
    return file_version(fd, path)


# blob checksums verified per file version (in-process): a later staging of the unchanged file skips
# re-hashing them; the tables of each (version, clusters, layers) staged, and the rebuild graphs and
# device row maps built on them, so that restaging an unchanged file skips building them again
_VERIFIED: dict[tuple, set[str]] = {}
_PLANS: OrderedDict[tuple, _PlanCache] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_PLAN_CACHE_SIZE = 32
_GRAPHS_PER_ENTRY = 256


def forget_verified(path: str | os.PathLike[str] | None = None, *, persisted: bool = True) -> None:
    """Drop the record of verified blobs and the cached tables (of one file, or all).

    ``persisted=False`` keeps the cross-process record: what a new process would find.
    """
    _flush_records()
    with _CACHE_LOCK:
        if path is None:
            _VERIFIED.clear()
            _PLANS.clear()
        else:
            p = str(os.path.realpath(path))
            for k in [k for k in _VERIFIED if k[0] == p]:
                del _VERIFIED[k]
            for k in [k for k in _PLANS if k[0][0] == p]:
                del _PLANS[k]
    if persisted:
        forget_record(path)
        _forget_tables(path)


_RECORDS: list[Future] = []


def _flush_records() -> None:
    """Wait for the cross-process records being written in the background."""
    while _RECORDS:
        _RECORDS.pop().result()


# --------------------------------------------------------------------------------------------
# the loader's tables kept across processes (next to the verified-blob record, same trust and
# version rules): a new process staging a file some process staged before (or compress_document
# prepared) copies them instead of building them, which is most of a first load's host work

_TABLES_MAGIC = b"KITETBL1"   # bump the digit when _stage_layer's tables or _SidePlan change meaning
_TABLES_KEPT = 64


def _tables_dir():
    from kite.paths import cache_dir

    return cache_dir() / "upc_tables"


def _tables_file(ckey: tuple):
    """One file per (file path, selection, layers, H, d); its name starts with the path's hash."""
    version, clusters, layers, H, d = ckey
    path_h = hashlib.sha256(version[0].encode()).hexdigest()[:16]
    sel_h = hashlib.sha256(json.dumps([list(clusters), list(layers), H, d]).encode()).hexdigest()[:16]
    return _tables_dir() / f"{path_h}-{sel_h}.tbl"


def _save_tables(ckey: tuple, header_sum: str, layers: dict[int, tuple[_LayerPlan, np.ndarray]]) -> None:
    """Best effort: a cache that cannot be written only costs building the tables again."""
    from kite.atomic import write_bytes

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
        target = _tables_file(ckey)
        write_bytes(target, b"".join([_TABLES_MAGIC, struct.pack("<I", len(meta)), meta]
                                     + [tbytes.tobytes() for _, (_, tbytes) in items]))
        kept = sorted(_tables_dir().glob("*.tbl"), key=lambda f: f.stat().st_mtime_ns)
        for old in kept[:-_TABLES_KEPT]:
            old.unlink(missing_ok=True)
    except OSError:
        pass


def _load_tables(ckey: tuple, header_sum: str) -> dict[int, tuple[_LayerPlan, np.ndarray]] | None:
    """The tables saved for exactly this file version, header, selection and geometry (else None)."""
    try:
        data = _tables_file(ckey).read_bytes()
        if data[:8] != _TABLES_MAGIC:
            return None
        (n,) = struct.unpack("<I", data[8:12])
        meta = json.loads(data[12:12 + n])
        if (meta.get("version") != list(ckey[0]) or meta.get("header") != header_sum
                or meta.get("key") != [list(ckey[1]), list(ckey[2]), ckey[3], ckey[4]]):
            return None
        body = memoryview(data)[12 + n:]
        out = {}
        for e in meta["layers"]:
            sides = {k: _SidePlan(**{**sp, "basis": tuple(sp["basis"])}) for k, sp in e["sides"].items()}
            tbytes = np.frombuffer(body[e["at"]:e["at"] + e["n"]], dtype=np.uint8)
            if tbytes.size != e["n"]:
                return None
            out[int(e["layer"])] = (_LayerPlan(off=e["off"], size=e["size"], sides=sides), tbytes)
        return out
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def _forget_tables(path=None) -> None:
    try:
        if path is None:
            files = list(_tables_dir().glob("*.tbl"))
        else:
            path_h = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:16]
            files = list(_tables_dir().glob(f"{path_h}-*.tbl"))
        for f in files:
            f.unlink(missing_ok=True)
    except OSError:
        pass


def _preadv_all(fd: int, bufs: list[tuple[str, memoryview]], pos: int, path) -> None:
    """Fill the buffers from consecutive file bytes starting at pos (preadv, short reads resumed)."""
    todo = [b for _, b in bufs]
    names = [k for k, _ in bufs]
    while todo:
        n = os.preadv(fd, todo[:512], pos)
        if n <= 0:
            raise BadInput(f"{path}: truncated .upc state (part {names[0]} is cut off)")
        pos += n
        while todo and n >= len(todo[0]):
            n -= len(todo[0])
            todo.pop(0)
            names.pop(0)
        if n:
            todo[0] = todo[0][n:]


def _stage_layer(state: StateFile, fd: int, view: np.ndarray, layer: int, region: int, keys: list[str],
                 blob_offs: list[int], tables_at: int, table_cap: int, H: int, d: int, verify: bool,
                 verified: set[str] | None = None, cached: tuple[_LayerPlan, np.ndarray] | None = None,
                 ) -> tuple[_LayerPlan, np.ndarray | None, list[str]]:
    """Read one layer's blobs into its region and lay out its tables.

    Returns (plan, table bytes when built here, blob keys whose checksum was checked here).
    ``verified``: keys already checked for this file version (not hashed again); ``cached``: the
    plan and table bytes of an earlier staging of the same version, copied instead of rebuilt.
    """
    # 1. blobs: raw ones read straight into the buffer (one preadv per run of blobs that lie back to
    # back in the file: each call hands the GIL back once, not once per blob), zstd ones decompressed
    import time

    t_read = t_verify = 0.0
    checked: list[str] = []
    mv = memoryview(view)
    runs: list[list[tuple[str, object, int]]] = []
    for key, off in zip(keys, blob_offs):
        e = state.index[key]
        if e.codec == "raw" and runs and runs[-1][-1][1].codec == "raw" \
                and runs[-1][-1][1].offset + runs[-1][-1][1].length == e.offset:
            runs[-1].append((key, e, off))
        else:
            runs.append([(key, e, off)])
    for run in runs:
        t0 = time.perf_counter()
        if run[0][1].codec == "raw":
            bufs = [(key, mv[off:off + e.length]) for key, e, off in run]
            _preadv_all(fd, bufs, state._data_start + run[0][1].offset, state.path)
            t1 = time.perf_counter()
            t_read += t1 - t0
            for key, dst in bufs:
                if verify and (verified is None or key not in verified):
                    state.check_blob(key, dst)
                    checked.append(key)
        else:
            (key, e, off), = run
            data = os.pread(fd, e.length, state._data_start + e.offset)
            if len(data) < e.length:
                raise BadInput(f"{state.path}: truncated .upc state (part {key} is cut off)")
            t1 = time.perf_counter()
            t_read += t1 - t0
            if verify and (verified is None or key not in verified):
                state.check_blob(key, data)
                checked.append(key)
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=e.raw_length)
            view[off:off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        t_verify += time.perf_counter() - t1
    t_tables = time.perf_counter()
    if cached is not None:
        plan, tbytes = cached
        view[tables_at:tables_at + tbytes.size] = tbytes
        return (_LayerPlan(off=plan.off, size=plan.size, sides=plan.sides,
                           times_ms={"read": t_read * 1e3, "verify": t_verify * 1e3,
                                     "tables": (time.perf_counter() - t_tables) * 1e3}), None, checked)
    # 2. tables
    lmeta, lt = _parse_blob(mv, blob_offs[0])
    gsz = int(lmeta["settings"]["group_size"])
    parts = [_parse_blob(mv, o) for o in blob_offs[1:]]          # K, V, K, V, ... of the chosen parts
    cur = tables_at

    def put(arr: np.ndarray) -> int:
        nonlocal cur
        b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        at = cur
        if at + b.size > tables_at + table_cap:
            raise BadInput(f"{state.path}: layer {layer} needs larger tables than budgeted")
        view[at:at + b.size] = b
        cur = _up(at + b.size)
        return at - region

    sides = {}
    for si, side in enumerate(("k", "v")):
        info = lmeta[side]
        if info.get("mode") != "pca":
            raise BadInput(f"{state.path}: layer {layer} {side} is not PCA-coded (the GPU path needs pca)")
        B, D = int(info["blocks"]), int(info["dim"])
        bits = _np_at(view, lt[f"{side}.bits"]).astype(np.int64)                  # [B, D]
        colbits = bits[bits > 0]
        R = int(colbits.size)
        blk_off = np.concatenate([[0], np.cumsum((bits > 0).sum(axis=1))]).astype(np.int64).tolist()
        mean = _np_at(view, lt[f"{side}.mean"]).astype(np.float32).reshape(-1)
        mean_at = put(mean)
        if f"{side}.basis.codes" in lt:
            bq = lmeta[f"{side}.basis"]
            bb = int(bq["fmt"][3:])
            codes, sc, mn = lt[f"{side}.basis.codes"], lt[f"{side}.basis.scale"], lt[f"{side}.basis.min"]
            btab = np.array([[0, D, D, codes[0] - region, sc[0] - region, mn[0] - region]], dtype=np.int64)
            basis = (put(btab), put(np.full(R, bb, dtype=np.uint8)),
                     put(np.arange(R, dtype=np.int64) * D * bb), put(np.arange(R, dtype=np.int64)), btab.tolist())
            kind = "int"
        else:
            off, dt, shape = lt[f"{side}.basis"]
            raw = np.frombuffer(view, dtype=np.uint8, count=int(np.prod(shape)) * _DT[dt][1], offset=off)
            basis = (put(raw.copy()), dt, int(shape[0]), int(shape[1]))
            kind = "float"
        Ts, tab, ovr = [], [], []
        row0 = 0
        for meta, pt in parts[si::2]:
            T = int(meta["T"])
            Ts.append(T)
            if R:
                c, s_, m_ = pt["codes"], pt["scale"], pt["min"]
                tab.append([row0, T, 0, c[0] - region, s_[0] - region, m_[0] - region])
            else:
                tab.append([row0, T, 0, 0, 0, 0])
            if "out.idx" in pt:
                idx = _np_at(view, pt["out.idx"]).astype(np.int64)
                xoff = pt["out.x"][0] - region
                n = int(pt["out.x"][2][1])
                ovr += [[row0 + int(t), xoff, n, k] for k, t in enumerate(idx.tolist())]
            row0 += T
        bitoff, goff, gs = _layouts(colbits, Ts, gsz)
        for p in range(len(tab)):
            tab[p][2] = int(gs[p])
        tab_np = np.array(tab, dtype=np.int64).reshape(-1, 6)
        sides[side] = _SidePlan(
            R=R, B=B, D=D, blk_off=blk_off, mean=mean_at, basis_kind=kind, basis=basis,
            parts_tab=put(tab_np), parts_tab_host=tab_np.tolist(), col_bits=put(colbits.astype(np.uint8)),
            col_bitoff=put(bitoff), col_goff=put(goff), max_T=max(Ts) if Ts else 0, n_ovr=len(ovr),
            ovr=put(np.array(ovr, dtype=np.int64).reshape(-1, 4)), ovr_host=ovr)
    plan = _LayerPlan(off=region, size=cur - region, sides=sides,
                      times_ms={"read": t_read * 1e3, "verify": t_verify * 1e3,
                                "tables": (time.perf_counter() - t_tables) * 1e3})
    return plan, view[tables_at:cur].copy(), checked


def stage_state(state: StateFile, selection: list[tuple[int, torch.Tensor | None]], part_positions: list[torch.Tensor],
                layers: list[int], *, n_layers: int, H: int, d: int, verify: bool = True,
                tier: HotTier | None = None, threads: int = 8, key: tuple | None = None,
                wait: bool = True) -> HotState:
    """Stage the chosen parts of ``state`` (``selection``: (cluster, keep mask or None)) for ``layers``.

    ``part_positions[i]``: the document positions of selection i's tokens (all of them, ascending).
    Layers are read in a thread pool; ``wait=False`` returns at once and :meth:`HotState.wait`
    blocks per layer (the GPU load starts on layer 0 while the rest is still being read).
    """
    tier = tier or HotTier(pin=False)
    s = state.meta.get("codec") or {}
    # rows: every token of every chosen part, in selection order; dest = its rank among kept ones
    pos_all = torch.cat(part_positions) if part_positions else torch.zeros(0, dtype=torch.long)
    kept = torch.cat([torch.ones(len(p), dtype=torch.bool) if keep is None else keep
                      for (_, keep), p in zip(selection, part_positions)]) if part_positions else \
        torch.zeros(0, dtype=torch.bool)
    kept_pos = pos_all[kept]
    order = torch.argsort(kept_pos)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    dest = torch.full((pos_all.numel(),), -1, dtype=torch.long)
    dest[kept] = rank
    # regions
    layer_set = sorted(set(layers))
    plans: list = [None] * n_layers
    jobs = []
    cur = 0
    bound = _table_bound(H, d, len(selection), s)
    for layer in layer_set:
        keys = [f"L{layer}"] + [f"c{c}/L{layer}/{side}" for c, _ in selection for side in ("K", "V")]
        for k in keys:
            if k not in state.index:
                raise BadInput(f"{state.path}: no part {k!r} in this state")
        region = cur
        offs = []
        for k in keys:
            offs.append(cur)
            cur = _up(cur + state.index[k].raw_length)
        tables_at = cur
        cur = _up(cur + bound, _ALIGN)
        jobs.append((layer, region, keys, offs, tables_at, bound))
    buf = tier.buffer(max(cur, 1))
    view = buf.numpy()
    nread = sum(state.index[k].length for _, _, keys, *_ in jobs for k in keys)
    fd = state._fh.fileno()
    version = _file_version(fd, os.path.realpath(state.path))
    ckey = (version, tuple(c for c, _ in selection), tuple(layer_set), H, d)
    with _CACHE_LOCK:
        verified = _VERIFIED.get(version)
        entry = _PLANS.get(ckey)
        if entry is None:
            entry = _PLANS[ckey] = _PlanCache()
            while len(_PLANS) > _PLAN_CACHE_SIZE:
                _PLANS.popitem(last=False)
        _PLANS.move_to_end(ckey)
    header_sum = getattr(state, "header_sum", None)
    if verify and verified is None and header_sum is not None:
        # checked in another process (or by the writer) for this very version and header
        rec = verified_record(version, header_sum)
        if rec:
            with _CACHE_LOCK:
                verified = _VERIFIED.setdefault(version, set())
                verified.update(rec)
    verified = set(verified) if verified else None   # a snapshot: other threads may add to the original
    if header_sum is not None and records_enabled() and not all(layer in entry.layers for layer in layer_set):
        # tables another process built for this very version (checked against today's layout)
        stored = _load_tables(ckey, header_sum)
        if stored is not None and all(
                layer in stored and stored[layer][0].off == region and stored[layer][1].size <= cap
                and stored[layer][0].size == tables_at - region + stored[layer][1].size
                for layer, region, _, _, tables_at, cap in jobs):
            with _CACHE_LOCK:
                for layer in layer_set:
                    entry.layers.setdefault(layer, stored[layer])
    hot = HotState(key=key or (), buffer=buf, H=H, d=d, rows=int(pos_all.numel()), dest=dest,
                   positions=kept_pos[order], layers=plans, bytes_read=nread,
                   _graphs=entry.graphs, _dest_dev=entry.dest_dev,
                   cached_tables=all(layer in entry.layers for layer in layer_set))
    pending = [len(jobs), False, False]   # layers still to stage, any blob checked, any tables built

    def one(layer, region, keys, offs, tables_at, cap):
        try:
            plan, tbytes, checked = _stage_layer(state, fd, view, layer, region, keys, offs, tables_at, cap, H, d,
                                                 verify, verified, entry.layers.get(layer))
        except BaseException:
            with _CACHE_LOCK:
                pending[0] = -1        # a failed staging records nothing across processes
            raise
        if tbytes is not None:
            entry.layers[layer] = (plan, tbytes)
        with _CACHE_LOCK:
            # remember the checks only while the file is still the version they were made on
            unchanged = same_version(fd, version)
            if checked and unchanged:
                _VERIFIED.setdefault(version, set()).update(checked)
                pending[1] = True
            pending[2] = pending[2] or tbytes is not None
            pending[0] -= 1
            last = pending[0] == 0
            done = set(_VERIFIED.get(version, ())) if last and pending[1] else None
            keep = last and verify and unchanged and header_sum is not None and records_enabled()
            tables = {l: entry.layers[l] for l in layer_set} if keep and (pending[2] or not _tables_file(ckey).exists()) \
                else None
        if last and header_sum is not None:
            # the whole staging checked out: record it for other processes, off the load's path
            _RECORDS[:] = [f for f in _RECORDS if not f.done()]
            if done is not None:
                _RECORDS.append(_pool(1).submit(record_verified, version, header_sum, done))
            if tables is not None:
                _RECORDS.append(_pool(1).submit(_save_tables, ckey, header_sum, tables))
        return plan

    if threads <= 1:
        for job in jobs:
            plans[job[0]] = one(*job)
        return hot
    pool = _pool(threads)
    futures: list[Future | None] = [None] * n_layers
    for job in jobs:
        futures[job[0]] = pool.submit(one, *job)
    hot._futures = futures
    if wait:
        hot.wait_all()
    return hot


def prepare_state(path, *, threads: int = 8) -> bool:
    """Stage a state file once, whole (every cluster and layer, as ``load_prefix`` with no choice
    stages it), so that its loader tables are kept for later processes: their first load of the
    file copies them instead of building them. ``compress_document`` calls it on a GPU machine
    after writing. Checksums are verified as a load would (none when the writer recorded the file).
    Returns False (and stages nothing) when records are off or the state is not PCA-coded.
    """
    if not records_enabled():
        return False
    from kite.upcycle.load import select_clusters

    with StateFile(path) as state:
        geo = (state.meta.get("model") or {}).get("geometry") or {}
        if not supports_state(state) or not geo:
            return False
        info = {c["id"]: c for c in state.meta["clusters"]}
        chosen = select_clusters(state, None)
        positions = [torch.cat([torch.arange(s, e) for s, e in info[c]["token_ranges"]]) for c in chosen]
        L = int(geo["n_layers"])
        stage_state(state, [(c, None) for c in chosen], positions, list(range(L)), n_layers=L,
                    H=int(geo["n_kv_heads"]), d=int(geo["head_dim"]), tier=HotTier(pin=False), threads=threads)
    _flush_records()
    return True


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(n: int) -> ThreadPoolExecutor:
    if n not in _POOLS:
        _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="kite-stage")
    return _POOLS[n]


# --------------------------------------------------------------------------------------------
# load


class _Views:
    """Typed views into one layer's region (device or host)."""

    def __init__(self, region: torch.Tensor):
        self.r = region

    def t(self, off: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        return self.r[off:off + n * dtype.itemsize].view(dtype)


def load_staged(hot: HotState, *, device, dtype: torch.dtype, cos: torch.Tensor | None, sin: torch.Tensor | None,
                out: list[tuple[torch.Tensor, torch.Tensor]] | None = None, n_layers: int | None = None,
                compute_dtype: torch.dtype | None = None, staging: torch.Tensor | None = None,
                use_graphs: bool = True) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Rebuild the staged layers on ``device``: per layer (keys [H, T_out, d], values) in ``dtype``.

    ``cos`` / ``sin`` [T_out, d] float32 on ``device``: RoPE at the kept positions (row order).
    ``out``: write into these tensors instead ([H, >= T_out, d] each, rows 0..T_out-1 filled), e.g.
    a static cache's. ``compute_dtype``: coefficient / basis precision of the matmul (default bf16
    on a GPU, float32 elsewhere). ``staging``: a device buffer of >= hot.nbytes to copy into.
    ``use_graphs``: on a GPU, capture each layer's rebuild on the second load into the same buffers
    (kept on ``hot``) and replay it on every later one; a first load runs eagerly.
    Returns lists over layers (None where the layer was not staged).
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    cdt = compute_dtype or (torch.bfloat16 if cuda else torch.float32)
    L = n_layers or len(hot.layers)
    H, d, T = hot.H, hot.d, hot.rows
    T_out = int(hot.positions.numel())
    keys: list[torch.Tensor | None] = [None] * L
    values: list[torch.Tensor | None] = [None] * L
    if cuda:
        if staging is None or staging.numel() < hot.nbytes:
            staging = torch.empty(hot.nbytes, dtype=torch.uint8, device=dev)
        copy_stream = _copy_stream(dev)
        dd = hot._dest_dev.get(dev)
        if dd is None or (dd[0] is not hot.dest and not torch.equal(dd[0], hot.dest)):
            dd = hot._dest_dev[dev] = (hot.dest, hot.dest.to(dev))
        dest = dd[1]
        if use_graphs and len(hot._graphs) > _GRAPHS_PER_ENTRY:   # many buffers seen: start again
            torch.cuda.synchronize(dev)
            hot._graphs.clear()
        main = torch.cuda.current_stream(dev)
        copy_stream.wait_stream(main)   # staging may still be read by an earlier load on `main`
    else:
        staging = hot.buffer
        dest = hot.dest
    if out is None:
        alloc = torch.empty(2, L, H, T_out, d, dtype=dtype, device=dev) if L else None
    for layer in range(L):
        plan = hot.wait(layer)
        if plan is None:
            continue
        region = staging[plan.off:plan.off + plan.size]
        if cuda:
            with torch.cuda.stream(copy_stream):
                region.copy_(hot.buffer[plan.off:plan.off + plan.size], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(copy_stream)
            main.wait_event(ev)
        if out is not None:
            k_out, v_out = out[layer]
        else:
            k_out, v_out = alloc[0, layer], alloc[1, layer]
        args = dict(dest=dest, cos=cos, sin=sin, H=H, d=d, rows=T, compute_dtype=cdt)
        gkey = (layer, region.data_ptr(), k_out.data_ptr(), v_out.data_ptr(),
                None if cos is None else cos.data_ptr(), cdt)
        if cuda and use_graphs and gkey in hot._graphs:
            # the same launches again for these buffers: replay a captured graph (the eager launches
            # cost ~0.3 ms of host time per layer, more than the GPU work). A first load runs eagerly
            # and only marks the buffers: capturing 28 graphs costs more than one load saves.
            g = hot._graphs[gkey]
            if g is None:
                rebuild_layer(region, plan, k_out, v_out, **args)     # warm-up (and this load's result)
                g = torch.cuda.CUDAGraph()
                # one memory pool for every rebuild graph: their temporaries die inside the capture
                with torch.cuda.graph(g, pool=_GRAPH_POOLS.get(dev)):
                    rebuild_layer(region, plan, k_out, v_out, **args)
                _GRAPH_POOLS.setdefault(dev, g.pool())
                hot._graphs[gkey] = g
            g.replay()
        else:
            if cuda and use_graphs:
                hot._graphs[gkey] = None   # seen once: captured on the next load into these buffers
            rebuild_layer(region, plan, k_out, v_out, **args)
        keys[layer] = k_out if out is not None else alloc[0, layer]
        values[layer] = v_out if out is not None else alloc[1, layer]
    return keys, values


def rebuild_layer(region: torch.Tensor, plan: _LayerPlan, k_out: torch.Tensor, v_out: torch.Tensor, *,
                  dest: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, H: int, d: int, rows: int,
                  compute_dtype: torch.dtype) -> None:
    """One staged layer (``region``: its bytes, on the output's device) -> keys / values rows."""
    dev, cdt, T = k_out.device, compute_dtype, rows
    v = _Views(region)
    for side, dst in (("k", k_out), ("v", v_out)):
        sp = plan.sides[side]
        R, B, D = sp.R, sp.B, sp.D
        P = len(sp.parts_tab_host)
        if sp.basis_kind == "int":
            btab, bbits, bbitoff, bgoff, btab_host = sp.basis
            Bt = torch.empty(R, D, dtype=cdt, device=dev)
            pca_coefs(region, v.t(btab, torch.int64, 6).view(1, 6), D, v.t(bbits, torch.uint8, R),
                      v.t(bbitoff, torch.int64, R).view(1, R), v.t(bgoff, torch.int64, R).view(1, R), Bt,
                      tab_host=btab_host)
        else:
            off, dt, Dn, Rn = sp.basis
            tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dt]
            Bt = v.t(off, tdt, Dn * Rn).view(Dn, Rn).t().to(cdt)
        Ct = torch.empty(R, T, dtype=cdt, device=dev)
        pca_coefs(region, v.t(sp.parts_tab, torch.int64, 6 * P).view(P, 6), sp.max_T,
                  v.t(sp.col_bits, torch.uint8, R), v.t(sp.col_bitoff, torch.int64, P * R).view(P, R),
                  v.t(sp.col_goff, torch.int64, P * R).view(P, R), Ct, tab_host=sp.parts_tab_host)
        if B == 1:
            Y = Ct.t() @ Bt if R else torch.zeros(T, D, dtype=cdt, device=dev)
        else:
            Y = torch.zeros(B, T, D, dtype=cdt, device=dev)
            for b in range(B):
                lo, hi = sp.blk_off[b], sp.blk_off[b + 1]
                if hi > lo:
                    torch.mm(Ct[lo:hi].t(), Bt[lo:hi], out=Y[b])
        mean = v.t(sp.mean, torch.float32, H * d)
        ovr = v.t(sp.ovr, torch.int64, 4 * sp.n_ovr).view(-1, 4) if sp.n_ovr else None
        rope = side == "k" and cos is not None
        pca_finish(dst, Y, mean, D, dest=dest, ovr=ovr, ovr_host=sp.ovr_host, base=region,
                   cos=cos if rope else None, sin=sin if rope else None)


_STREAMS: dict = {}
_GRAPH_POOLS: dict = {}


def _copy_stream(dev: torch.device):
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=dev)
    return _STREAMS[key]
