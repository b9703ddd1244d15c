"""Stage the blobs a load needs into (pinned) host memory, one region per layer, with its tables.

Every blob of a chosen layer (the layer's shared codec, then each chosen part's K and V) is read
from the file (``preadv`` straight into the buffer, in a thread pool, checksums verified there),
followed by the small aligned tables the rebuild reads (:mod:`.tables`). Checksums are verified once
per file version and remembered (:mod:`.caches`, and across processes through
:mod:`kite.upcycle.format.versions`); the tables are reused the same way. ``verify=False`` records
nothing. Supported: states whose keys and values are PCA-coded, at their layers' widths (:func:`supports_state`).
A state coded on bases across layers has one region per group of layers (its codec and parts, under
its first layer), staged in geometry ``H = 1, d = g*H*d``; its regenerator columns are staged as
indices into the regenerator's basis, which the rebuild gathers on the device.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from kite.errors import BadInput
from kite.upcycle.codec.checks import check_layer, check_part
from kite.upcycle.codec.coders import regen_columns
from kite.upcycle.codec.regenerator import resolve
from kite.upcycle.format import codec_blob
from kite.upcycle.format.bitlayout import parts_layout
from kite.upcycle.format.container import StateFile
from kite.upcycle.codec.groups import group_geometry
from kite.upcycle.format.names import group_of, groups_of, layer_keys
from kite.upcycle.format.versions import record_verified, records_enabled, same_version, verified_record
from kite.upcycle.load import caches
from kite.upcycle.load.hot_tier import HotState, HotTier
from kite.upcycle.load.selection import select
from kite.upcycle.load.tables import (ALIGN, LayerPlan, SidePlan, load_tables, round_up, save_tables, table_bound,
                                      tables_file)


def supports_state(state: StateFile) -> bool:
    """Whether the GPU path decodes this state: PCA keys and values, every part at its layer's widths
    (a state with per-label ratios decodes on the host; its parts have widths of their own); a state
    coded on bases across layers when each part keeps at most one sink row (the ``ratio=R`` presets':
    a group's sink row is sliced per layer)."""
    c = state.meta.get("codec") or {}
    grouped_ok = "layer_groups" not in state.meta or (int(c.get("outliers", 0)) == 0
                                                      and int(c.get("sink_tokens", 1)) <= 1)
    return c.get("k_mode") == "pca" and c.get("v_mode") == "pca" and "label_ratios" not in state.meta and grouped_ok


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


def stage_layer(state: StateFile, fd: int, view: np.ndarray, layer: int, region: int, keys: list[str],
                 blob_offs: list[int], tables_at: int, table_cap: int, H: int, d: int, verify: bool,
                 verified: set[str] | None = None, cached: tuple[LayerPlan, np.ndarray] | None = None,
                 regenerator=None, members: int = 1) -> tuple[LayerPlan, np.ndarray | None, list[str]]:
    """Read one layer's blobs into its region and lay out its tables.

    Returns (plan, table bytes when built here, blob keys whose checksum was checked here).
    ``verified``: keys already checked for this file version (not hashed again); ``cached``: the
    plan and table bytes of an earlier staging of the same version, copied instead of rebuilt.
    ``regenerator``: the state's regenerator (its ``rpca`` sides' basis columns go into the tables).
    ``members``: the layers of the header's group staged here (``H``, ``d``: the group's geometry).
    """
    # 1. blobs: raw ones read straight into the buffer (one preadv per run of blobs that lie back to
    # back in the file: each call hands the GIL back once, not once per blob), zstd ones decompressed
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
            _preadv_all(fd, bufs, state.data_start + run[0][1].offset, state.path)
            t1 = time.perf_counter()
            t_read += t1 - t0
            for key, dst in bufs:
                if verify and (verified is None or key not in verified):
                    state.check_blob(key, dst)
                    checked.append(key)
        else:
            (key, e, off), = run
            data = os.pread(fd, e.length, state.data_start + e.offset)
            if len(data) < e.length:
                raise BadInput(f"{state.path}: truncated .upc state (part {key} is cut off)")
            t1 = time.perf_counter()
            t_read += t1 - t0
            if verify and (verified is None or key not in verified):
                state.check_blob(key, data)
                checked.append(key)
            raw = state.inflate(key, data)
            view[off:off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        t_verify += time.perf_counter() - t1
    t_tables = time.perf_counter()
    if cached is not None:
        plan, tbytes = cached
        view[tables_at:tables_at + tbytes.size] = tbytes
        return (LayerPlan(off=plan.off, size=plan.size, sides=plan.sides,
                           times_ms={"read": t_read * 1e3, "verify": t_verify * 1e3,
                                     "tables": (time.perf_counter() - t_tables) * 1e3}), None, checked)
    # 2. the blobs checked against the layer codec and their clusters' token counts (nothing below
    # reads a length or an offset these checks have not bounded), then the tables
    lmeta, lt, parts = _checked_layer(state, view, mv, layer, keys, blob_offs, H, d)
    gsz = int(lmeta["settings"]["group_size"])
    even = bool(lmeta["settings"].get("even_groups", False))
    cur = tables_at

    def put(arr: np.ndarray) -> int:
        nonlocal cur
        b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        at = cur
        if at + b.size > tables_at + table_cap:
            raise BadInput(f"{state.path}: layer {layer} needs larger tables than budgeted")
        view[at:at + b.size] = b
        cur = round_up(at + b.size)
        return at - region

    sides = {}
    for si, side in enumerate(("k", "v")):
        info = lmeta[side]
        if info.get("mode") not in ("pca", "rpca"):
            raise BadInput(f"{state.path}: layer {layer} {side} is not PCA-coded (the GPU path needs pca)")
        B, D = int(info["blocks"]), int(info["dim"])
        bits = codec_blob.numpy_at(view, lt[f"{side}.bits"]).astype(np.int64)                  # [B, D]
        colbits = bits[bits > 0]
        R = int(colbits.size)
        blk_off = np.concatenate([[0], np.cumsum((bits > 0).sum(axis=1))]).astype(np.int64).tolist()
        mean = codec_blob.numpy_at(view, lt[f"{side}.mean"]).astype(np.float32).reshape(-1)
        mean_at = put(mean)
        if info["mode"] == "rpca" and regenerator is None:
            raise BadInput(f"{state.path}: part {keys[0]} is coded on a regenerator's basis, and the header names none")
        if info["mode"] == "rpca" and members > 1:
            # a group's: the columns are gathered from the regenerator's basis on the device at the
            # rebuild (a copy here would be g*H*d x R floats per load); only their indices are staged
            basis = (put(np.nonzero(bits.reshape(-1) > 0)[0].astype(np.int64)), R)
            kind = "regen"
        elif info["mode"] == "rpca":   # the regenerator's columns, as a float basis [D, R]
            cols = regen_columns(regenerator.side(layer, side)[2], torch.from_numpy(bits))
            basis = (put(cols.numpy()), "f32", int(cols.shape[0]), int(cols.shape[1]))
            kind = "float"
        elif f"{side}.basis.codes" in lt:
            bq = lmeta[f"{side}.basis"]
            bb = int(bq["fmt"][3:])
            codes, sc, mn = lt[f"{side}.basis.codes"], lt[f"{side}.basis.scale"], lt[f"{side}.basis.min"]
            btab = np.array([[0, D, D, codes[0] - region, sc[0] - region, mn[0] - region]], dtype=np.int64)
            basis = (put(btab), put(np.full(R, bb, dtype=np.uint8)),
                     put(np.arange(R, dtype=np.int64) * D * bb), put(np.arange(R, dtype=np.int64)), btab.tolist())
            kind = "int"
        else:
            off, dt, shape = lt[f"{side}.basis"]
            raw = np.frombuffer(view, dtype=np.uint8, count=int(np.prod(shape)) * codec_blob.ITEMSIZE[dt], offset=off)
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
                idx = codec_blob.numpy_at(view, pt["out.idx"]).astype(np.int64)
                xoff = pt["out.x"][0] - region
                n = int(pt["out.x"][2][1])
                ovr += [[row0 + int(t), xoff, n, k] for k, t in enumerate(idx.tolist())]
            row0 += T
        bitoff, goff, gs = parts_layout(colbits, Ts, gsz, even)
        for p in range(len(tab)):
            tab[p][2] = int(gs[p])
        tab_np = np.array(tab, dtype=np.int64).reshape(-1, 6)
        if members > 1 and ovr:
            # a group's sink rows are [1, 1, g*H*d]: member layer i's are the i-th slice of H*d, so
            # its table is the group's with each row's offset moved by i*H*d fp16 values (one sink a
            # part: supports_state; the header's group size, D checked against it above)
            if any(n != 1 for _, _, n, _ in ovr):
                raise BadInput(f"{state.path}: layer {layer}: a part of a layer group keeps more than one sink row")
            W = D // members
            ovr = [[t, off + i * W * 2, n, k] for i in range(members) for t, off, n, k in ovr]
        sides[side] = SidePlan(
            R=R, B=B, D=D, blk_off=blk_off, mean=mean_at, basis_kind=kind, basis=basis,
            parts_tab=put(tab_np), parts_tab_host=tab_np.tolist(), col_bits=put(colbits.astype(np.uint8)),
            col_bitoff=put(bitoff), col_goff=put(goff), max_T=max(Ts) if Ts else 0, n_ovr=len(ovr),
            ovr=put(np.array(ovr, dtype=np.int64).reshape(-1, 4)), ovr_host=ovr)
    plan = LayerPlan(off=region, size=cur - region, sides=sides,
                      times_ms={"read": t_read * 1e3, "verify": t_verify * 1e3,
                                "tables": (time.perf_counter() - t_tables) * 1e3})
    return plan, view[tables_at:cur].copy(), checked


def _checked_layer(state: StateFile, view: np.ndarray, mv: memoryview, layer: int, keys: list[str], offs: list[int],
                   H: int, d: int):
    """The layer codec's (meta, table) and each part's, located in place and checked
    (:mod:`kite.upcycle.codec.checks`); BadInput naming the first part that is wrong."""
    tokens = {c["id"]: c["n_tokens"] for c in state.meta["clusters"]}
    located = []
    for key, off in zip(keys, offs):
        try:
            located.append(codec_blob.locate(mv, off, off + state.index[key].raw_length))
        except BadInput as exc:
            raise BadInput(f"{state.path}: part {key} does not decode ({str(exc).removeprefix('corrupt .upc state ')})") \
                from None
    (lmeta, lt), parts = located[0], located[1:]
    try:
        bits = {side: codec_blob.numpy_at(view, lt[f"{side}.bits"]) for side in ("k", "v") if f"{side}.bits" in lt}
        widths = check_layer(lmeta, {n: (dt, sh) for n, (_, dt, sh) in lt.items()}, bits, H, d)
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{state.path}: part {keys[0]} does not decode ({exc})") from None
    for key, (meta, pt) in zip(keys[1:], parts):
        cluster, _, side = key.split("/")
        side = side.lower()
        idx = codec_blob.numpy_at(view, pt["out.idx"]) if "out.idx" in pt and pt["out.idx"][1] in ("i16", "i32") \
            and len(pt["out.idx"][2]) == 1 else None
        try:
            check_part(lmeta, side, widths.get(side), meta, {n: (dt, sh) for n, (_, dt, sh) in pt.items()},
                       tokens[int(cluster[1:])], H, d, outliers=idx)
        except (ValueError, KeyError, TypeError) as exc:
            raise BadInput(f"{state.path}: part {key} does not decode ({exc})") from None
    return lmeta, lt, parts


class StagingRun:
    """One staging of a state's layers, each staged by :meth:`stage` (on any thread). When the last
    layer is in, and none failed, it records for other processes what this staging established: the
    blob checksums it checked and the tables it built, while the file is still the version they were
    made on."""

    def __init__(self, state: StateFile, fd: int, view: np.ndarray, *, ckey: tuple, entry, verified: set[str] | None,
                 layers: list[int], H: int, d: int, verify: bool, regenerator, header_sum,
                 geometry: dict[int, tuple[int, int]] | None = None) -> None:
        self.state, self.fd, self.view = state, fd, view
        self.ckey, self.entry, self.verified = ckey, entry, verified
        self.layers, self.H, self.d = layers, H, d
        self.geometry = geometry or {}     # a layer group's (H, d), under its first layer
        self.verify, self.regenerator, self.header_sum = verify, regenerator, header_sum
        self.version = state.version
        self.left = len(layers)        # layers still to stage; -1 once one failed (nothing is recorded)
        self.checked_any = False       # a blob's checksum was checked by this staging
        self.built_any = False         # a layer's tables were built (not copied) by this staging

    def stage(self, layer: int, region: int, keys: list[str], offs: list[int], tables_at: int, cap: int) -> LayerPlan:
        try:
            H, d = self.geometry.get(layer, (self.H, self.d))
            plan, tbytes, checked = stage_layer(self.state, self.fd, self.view, layer, region, keys, offs, tables_at,
                                                cap, H, d, self.verify, self.verified,
                                                self.entry.layers.get(layer), self.regenerator,
                                                members=(H * d) // (self.H * self.d))
        except BaseException:
            with caches.LOCK:
                self.left = -1
            raise
        if tbytes is not None:
            self.entry.layers[layer] = (plan, tbytes)
        with caches.LOCK:
            # remember the checks only while the file is still the version they were made on
            unchanged = same_version(self.fd, self.version)
            if checked and unchanged:
                caches.VERIFIED.setdefault(self.version, set()).update(checked)
                self.checked_any = True
            self.built_any = self.built_any or tbytes is not None
            self.left -= 1
            last = self.left == 0
            done = set(caches.VERIFIED.get(self.version, ())) if last and self.checked_any else None
            keep = last and self.verify and unchanged and self.header_sum is not None and records_enabled()
            tables = {l: self.entry.layers[l] for l in self.layers} \
                if keep and (self.built_any or not tables_file(self.ckey).exists()) else None
        if last and self.header_sum is not None:
            # the whole staging checked out: record it for other processes, off the load's path
            if done is not None:
                caches.record_in_background(record_verified, self.version, self.header_sum, done)
            if tables is not None:
                caches.record_in_background(save_tables, self.ckey, self.header_sum, tables)
        return plan


def stage_state(state: StateFile, selection: list[tuple[int, torch.Tensor | None]], part_positions: list[torch.Tensor],
                layers: list[int], *, n_layers: int, H: int, d: int, verify: bool = True,
                tier: HotTier | None = None, threads: int = 8, key: tuple | None = None,
                wait: bool = True, regenerator=None) -> HotState:
    """Stage the chosen parts of ``state`` (``selection``: (cluster, keep mask or None)) for ``layers``.
    ``regenerator``: the state's (required when its header names one).

    ``part_positions[i]``: the document positions of selection i's tokens (all of them, ascending).
    Layers are read in a thread pool; ``wait=False`` returns at once and :meth:`HotState.wait`
    blocks per layer (the GPU load starts on layer 0 while the rest is still being read). A layer of
    a layer group stages its group (under the group's first layer); the rebuild writes the layers asked.
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
    # regions: one per layer, or per group of layers coded together (under its first layer)
    groups = groups_of(state.meta, n_layers)
    wanted = sorted(set(layers))
    layer_set = sorted({group_of(groups, layer)[0] for layer in wanted})
    geometry = {a: (group_geometry((a, b), H, d) if b - a > 1 else (H, d)) for a, b in groups if a in layer_set}
    plans: list = [None] * n_layers
    jobs = []
    cur = 0
    regen_fp = (state.meta.get("regenerator") or {}).get("fingerprint")
    if regen_fp is not None:
        regenerator = resolve(regen_fp, regenerator)
    for layer in layer_set:
        Hs, ds = geometry[layer]
        grouped = (Hs, ds) != (H, d)
        # (a group's rpca basis is not copied into its tables; its sink tables are one per member)
        bound = table_bound(Hs, ds, len(selection), s, regenerated=regen_fp is not None and not grouped) \
            + (2 * 32 * (ds // (H * d)) * int(s.get("sink_tokens", 1)) if grouped else 0)
        keys = layer_keys(layer, [c for c, _ in selection])
        for k in keys:
            if k not in state.index:
                raise BadInput(f"{state.path}: no part {k!r} in this state")
        region = cur
        offs = []
        for k in keys:
            offs.append(cur)
            cur = round_up(cur + state.index[k].raw_length)
        tables_at = cur
        cur = round_up(cur + bound, ALIGN)
        jobs.append((layer, region, keys, offs, tables_at, bound))
    buf = tier.buffer(max(cur, 1))
    view = buf.numpy()
    nread = sum(state.index[k].length for _, _, keys, *_ in jobs for k in keys)
    fd = state.fileno()
    version = state.version
    ckey = (version, tuple(c for c, _ in selection), tuple(layer_set), H, d)
    entry, verified = caches.plan_entry(ckey)
    header_sum = getattr(state, "header_sum", None)
    if verify and verified is None and header_sum is not None:
        # checked in another process (or by the writer) for this very version and header
        rec = verified_record(version, header_sum)
        if rec:
            with caches.LOCK:
                verified = caches.VERIFIED.setdefault(version, set())
                verified.update(rec)
    verified = set(verified) if verified else None   # a snapshot: other threads may add to the original
    if header_sum is not None and records_enabled() and not all(layer in entry.layers for layer in layer_set):
        # tables another process built for this very version (checked against today's layout)
        stored = load_tables(ckey, header_sum)
        if stored is not None and all(
                layer in stored and stored[layer][0].off == region and stored[layer][1].size <= cap
                and stored[layer][0].size == tables_at - region + stored[layer][1].size
                for layer, region, _, _, tables_at, cap in jobs):
            with caches.LOCK:
                for layer in layer_set:
                    entry.layers.setdefault(layer, stored[layer])
    hot = HotState(key=key or (), buffer=buf, H=H, d=d, rows=int(pos_all.numel()), dest=dest,
                   positions=kept_pos[order], layers=plans, bytes_read=nread,
                   graphs=entry.graphs, dest_dev=entry.dest_dev,
                   cached_tables=all(layer in entry.layers for layer in layer_set),
                   groups={a: (a, b) for a, b in groups if b - a > 1 and a in layer_set} or None,
                   wanted=wanted, regenerator=regenerator if len(groups) < n_layers else None)
    run = StagingRun(state, fd, view, ckey=ckey, entry=entry, verified=verified, layers=layer_set, H=H, d=d,
                     verify=verify, regenerator=regenerator, header_sum=header_sum, geometry=geometry)
    if threads <= 1:
        for job in jobs:
            plans[job[0]] = run.stage(*job)
        return hot
    pool = caches.pool(threads)
    futures: list = [None] * n_layers
    for job in jobs:
        futures[job[0]] = pool.submit(run.stage, *job)
    hot.futures = futures
    if wait:
        hot.wait_all()
    return hot


def prepare_state(path, *, threads: int = 8) -> bool:
    """Stage a state file once, whole (every cluster and layer, as ``load_prefix`` with no choice
    stages it), so that its loader tables are kept for later processes: their first load of the
    file copies them instead of building them. Writers call it after writing a state that will be
    loaded on a GPU (the pipeline does, for a model on a GPU). Checksums are verified as a load would
    (none when the writer recorded the file). Returns False (and stages nothing) when records are off
    or the state is not PCA-coded.
    """
    if not records_enabled():
        return False
    with StateFile(path) as state:
        geo = (state.meta.get("model") or {}).get("geometry") or {}
        if not supports_state(state) or not geo:
            return False
        sel = select(state, None)
        L = int(geo["n_layers"])
        stage_state(state, sel.parts, sel.part_positions, list(range(L)), n_layers=L,
                    H=int(geo["n_kv_heads"]), d=int(geo["head_dim"]), tier=HotTier(pin=False), threads=threads)
    caches.flush_records()
    return True
