"""The PCA codec of :mod:`kite.upcycle.codec`, batched over layers and parts, on any device.

:func:`encode_state` does what ``compress_document``'s per-layer loop does (``fit_layer`` per layer,
then ``encode`` per (cluster, layer)) in a few large operations, so it runs on a GPU without host
round trips until the blobs are serialized:

* **fit**: a batched Gram per side, then one eigendecomposition of every block of both sides
  (:func:`kite.kernels.eigh.eigh_desc`: the native Jacobi kernel for blocks of d <= 128 on a
  GPU, cuSOLVER's batched solver for larger blocks such as the joint-head 512 dims of Qwen2-7B);
  on a GPU the Gram and the projection run on TF32 tensor cores;
* **bit allocation**: :func:`allocate_bits_batched`, the codec's greedy reverse water-filling
  (``codec.allocate_bits``) as a sort: every increment (component, bit b) is ranked by its gain
  per stored bit, ironed so that bit b never ranks above bit b-1 (a running minimum along b), and
  the budget is spent down that order with the heap's rules (an increment that does not fit is
  skipped and ends its component; once an increment of plain cost T fails nothing fits);
* **stored basis**: each block's columns that get bits become rows of a [L, B, D, D] basis (a
  scatter by rank; rows past a block's last column stay zero), quantized in one launch per side
  (:func:`kite.kernels.quant.quantize_plan`, which also writes the decoded basis encode projects on);
* **encode**: the coefficients of all (cluster, layer) parts are one batched matmul per side over
  the tokens gathered once in part order, each part padded to whole groups with its last token
  (per head: over each head's d dims); the attention sinks are replaced by their part's mean
  column as the codec does, padding columns then repeat their part's last one; one launch per side
  quantizes every stored row at its own width into the places a *plan* computed on the device gives
  it (:func:`_plan`: runs of (layer, part, width), each part blob's codes one slice).

Nothing between the eigensolver and the codes waits for the host: every size and index is made on
the device. The host waits once for the small tables (bit allocations, run sizes) while the encode
runs, then copies exactly the bytes written on a copy stream (the side with more bits is encoded
first, so its copy runs while the other side is encoded) and builds the blobs from slices.

The byte format is the codec's (docs/upc-format.md): the layer blobs and part blobs it returns
are what ``codec.to_bytes`` gives for a ``LayerCodec`` / part ``Blob`` and read back with
``codec.from_bytes`` / ``codec.decode``. Results match the per-layer codec up to floating-point
summation order (the eigendecomposition on a GPU is float32; a coefficient near a quantization
boundary may land on the next code).

Supported: ``k_mode == v_mode == "pca"`` with ``outliers == 0`` (the ``ratio=R`` presets);
:func:`supports` says so, and the caller uses the per-layer codec otherwise.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kite.errors import KiteError
from kite.kernels.eigh import centered_gram, eigh_desc
from kite.kernels.quant import quantize_plan
from kite.upcycle import codec
from kite.upcycle.codec import CodecSettings, settings_for
from kite.upcycle.quant import INT_FORMATS

__all__ = ["supports", "allocate_bits_batched", "encode_state", "EncodedState"]


def supports(settings: CodecSettings | str | float | None) -> bool:
    """Whether :func:`encode_state` takes these settings (else use the per-layer codec)."""
    s = settings_for(settings)
    return s.k_mode == "pca" and s.v_mode == "pca" and s.outliers == 0 and s.max_bits <= 8


# --------------------------------------------------------------------------------------------
# bit allocation


def allocate_bits_batched(evals: torch.Tensor, budgets, T: int, d_in: int, s: CodecSettings) -> torch.Tensor:
    """``codec.allocate_bits`` for N layers at once: evals [N, B, r], budgets [N] -> int64 bits [N, B, r].

    Same greedy order as the heap (ties aside) and the same skip rules at the budget's edge; runs
    on ``evals``' device.
    """
    N, B, r = evals.shape
    dev = evals.device
    M = s.max_bits
    first = codec.first_bit_cost(T, d_in, s)
    dist = [codec._rel_distortion(b, s.range_mode) for b in range(M + 1)]
    drop = _const([1.0 - dist[1]] + [dist[b] - dist[b + 1] for b in range(1, M)], dev)
    cost = _const([first] + [float(T)] * (M - 1), dev)   # (cost[0] = x on a GPU would wait for the stream)
    lam = evals.double().reshape(N, B * r)
    # the heap's arithmetic: gain = lam * factor * T, priority = gain / cost
    prio = (lam[:, :, None] * drop) * T / cost                          # [N, C, M]
    eff = torch.cummin(prio, dim=2).values                              # bit b never before b-1
    valid = (lam > 0)[:, :, None].expand(N, B * r, M)
    eff = torch.where(valid, eff, torch.full_like(eff, -math.inf)).reshape(N, -1)
    order = torch.sort(eff, dim=1, descending=True, stable=True).indices   # [N, C*M]
    bit_of = order % M                                                  # 0 = the first bit
    comp_of = order // M
    ok_item = torch.gather(valid.reshape(N, -1), 1, order)
    c_sorted = cost[bit_of]
    budgets = _const(budgets, dev).reshape(N, 1)
    cum = torch.cumsum(c_sorted, dim=1)
    fits = (cum <= budgets) & ok_item
    n_items = fits.shape[1]
    all_fit = fits.all(dim=1)
    k = torch.where(all_fit, torch.full_like(all_fit, n_items, dtype=torch.long),
                    (~fits).long().argmax(dim=1))                       # first item that does not fit
    pos = torch.arange(n_items, device=dev)[None, :]
    taken = pos < k[:, None]
    # after a first bit fails (and only then), the started components' later bits still fit one
    # by one while the budget lasts; after a plain increment fails, nothing fits any more
    k_c = k.clamp_max(n_items - 1)
    first_failed = (~all_fit) & (bit_of.gather(1, k_c[:, None]).squeeze(1) == 0) \
        & ok_item.gather(1, k_c[:, None]).squeeze(1)
    started = torch.zeros(N, B * r, dtype=torch.long, device=dev)
    started.scatter_add_(1, comp_of, (taken & (bit_of == 0)).long())
    started = started > 0
    spent = torch.where(k[:, None] > 0, cum.gather(1, (k - 1).clamp_min(0)[:, None]), torch.zeros_like(budgets))
    cand = first_failed[:, None] & (pos > k[:, None]) & (bit_of > 0) & ok_item & started.gather(1, comp_of)
    cum2 = spent + torch.cumsum(torch.where(cand, c_sorted, torch.zeros_like(c_sorted)), dim=1)
    taken = taken | (cand & (cum2 <= budgets))
    bits = torch.zeros(N, B * r, dtype=torch.int64, device=dev)
    bits.scatter_add_(1, comp_of, taken.long())
    return bits.reshape(N, B, r)


# --------------------------------------------------------------------------------------------
# helpers


def _const(values, dev: torch.device) -> torch.Tensor:
    """A float64 host list on ``dev`` without a host sync (torch.tensor(..., device=cuda) waits
    for the stream: here, for the eigensolver)."""
    t = torch.tensor(values, dtype=torch.float64)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def _blob_bytes(meta: dict, table: list[tuple[str, str, list[int], object]]) -> bytes:
    """codec.to_bytes of a blob given as (name, dtype name, shape, bytes or list of buffers) rows."""
    head = codec.json.dumps({"m": meta, "t": [[n, dt, list(sh)] for n, dt, sh, _ in table]},
                            separators=(",", ":")).encode()
    bufs = [codec._MAGIC, codec.struct.pack("<I", len(head)), head]
    for *_, b in table:
        if isinstance(b, list):
            bufs += b
        else:
            bufs.append(b)
    return b"".join(bufs)


_PINNED: dict = {}
_COPY_STREAMS: dict = {}


def _to_host(tensors: list[torch.Tensor], after: torch.cuda.Event | None = None) -> list[np.ndarray]:
    """uint8 device tensors -> numpy views of host copies. On a GPU: pinned buffers filled on a copy
    stream once ``after`` has happened (default: once the work queued so far on the current stream is
    done), so the copies overlap the work queued after it (call _host_sync before reading them);
    plain .cpu() elsewhere."""
    if not tensors or not tensors[0].is_cuda:
        return [t.cpu().numpy() for t in tensors]
    dev = tensors[0].device
    cs = _COPY_STREAMS.get(dev)
    if cs is None:
        cs = _COPY_STREAMS[dev] = torch.cuda.Stream(device=dev)
    if after is None:
        cs.wait_stream(torch.cuda.current_stream(dev))
    else:
        cs.wait_event(after)
    out = []
    with torch.cuda.stream(cs):
        for t in tensors:
            n = t.numel()
            buf = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True)
            _PINNED[len(_PINNED)] = buf   # kept alive until _host_sync
            buf[:n].copy_(t.reshape(-1), non_blocking=True)
            t.record_stream(cs)           # not reused by the allocator before the copy is done
            out.append(buf[:n].numpy())
    return out


def _to_dev(dev: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Small int64 host tensors -> the device in one asynchronous copy (no host sync)."""
    if dev.type != "cuda" or not tensors:
        return [t.to(dev) for t in tensors]
    sizes = [t.numel() for t in tensors]
    buf = torch.empty(max(1, sum(sizes)), dtype=torch.int64, pin_memory=True)
    if sizes and sum(sizes):
        torch.cat([t.reshape(-1).to(torch.int64) for t in tensors], out=buf[:sum(sizes)])
    d = buf.to(dev, non_blocking=True)
    return [x.view(t.shape) for x, t in zip(torch.split(d[:sum(sizes)], sizes), tensors)]


def _host_sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    _PINNED.clear()


@dataclass
class EncodedState:
    """Serialized blobs: layer_blobs[l] (the 'L{l}' blob), part_blobs[l][c] = (K blob, V blob)."""

    layer_blobs: list[bytes]
    part_blobs: list[list[tuple[bytes, bytes]]]
    timings_ms: dict[str, float] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def add_to(self, writer, blob_key: Callable) -> None:
        """Add every blob to a StateWriter in compress_document's order (zstd tried in a thread pool)."""
        items = []
        for layer, lb in enumerate(self.layer_blobs):
            items.append((blob_key(None, layer), lb))
            for c, (kb, vb) in enumerate(self.part_blobs[layer]):
                items += [(blob_key(c, layer, "K"), kb), (blob_key(c, layer, "V"), vb)]
        writer.add_many(items)

    def nbytes(self) -> int:
        return sum(len(b) for b in self.layer_blobs) + sum(len(k) + len(v) for p in self.part_blobs for k, v in p)


class _Clock:
    def __init__(self, dev: torch.device, sync: bool):
        self.sync = sync and dev.type == "cuda"
        self.dev = dev
        self.times: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.sync:
            torch.cuda.synchronize(self.dev)
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + (now - self.t) * 1e3
        self.t = now


# --------------------------------------------------------------------------------------------
# fit


def _blocks(X: torch.Tensor, s: CodecSettings) -> tuple[torch.Tensor, int, int]:
    """One side's data as the PCA's blocks: [L*B, T, D] with B = 1, D = H*d (joint heads) or B = H, D = d."""
    L, H, T, d = X.shape
    if s.joint_heads:
        return X.permute(0, 2, 1, 3).reshape(L, T, H * d), 1, H * d
    return X.reshape(L * H, T, d), H, d


@dataclass
class _Plan:
    """Where quantize_plan puts the codes of rows at their bit widths, cut into the groups of parts.

    Runs (layer, part, width) lie in that order, each a whole number of bytes, so one part blob's
    codes (all its widths, ascending) are one slice. ``tables`` [4, L, C, W]: each run's first byte,
    bytes, first scale and scales."""

    base_bit: torch.Tensor    # [L*S, C] int64: first bit of row r's codes in part c
    base_sc: torch.Tensor     # [L*S, C] int64: index of row r's first scale in part c
    tables: torch.Tensor      # [4, L, C, W] int64


def _plan(row_bits: torch.Tensor, ng: torch.Tensor, gs: torch.Tensor, max_bits: int) -> _Plan:
    """The plan of rows [L, S] at bits row_bits (0: not stored) over C parts of ng groups of gs
    columns (device tensors; no host sync). Within a run the rows keep their order, each with its
    part's groups in order: the per-layer codec's (column, group) order of one width."""
    L, S = row_bits.shape
    w = torch.arange(max_bits + 1, device=row_bits.device)
    onehot = (row_bits[..., None] == w).long()                             # [L, S, W]
    rank = ((onehot.cumsum(1) - onehot) * onehot).sum(2)                   # among the layer's rows of its width
    count = onehot.sum(1)                                                  # [L, W]
    per_row = ng * gs                                                      # codes of one row in each part
    nbytes = (count[:, None, :] * per_row[None, :, None] * w + 7) // 8     # [L, C, W]
    nsc = count[:, None, :] * ng[None, :, None] * (w > 0)
    first = nbytes.reshape(-1).cumsum(0).view_as(nbytes) - nbytes
    first_sc = nsc.reshape(-1).cumsum(0).view_as(nsc) - nsc
    at = row_bits[:, :, None].expand(L, S, ng.numel())
    base_bit = first.transpose(1, 2).gather(1, at) * 8 + (rank * row_bits)[..., None] * per_row
    base_sc = first_sc.transpose(1, 2).gather(1, at) + rank[..., None] * ng
    return _Plan(base_bit.reshape(L * S, -1), base_sc.reshape(L * S, -1), torch.stack([first, nbytes, first_sc, nsc]))


def _run_sizes(plan: _Plan, upper: tuple[int, int]) -> tuple[int, int]:
    """Buffer sizes for a plan: exact on the CPU, the upper bound on a GPU (no host sync)."""
    if plan.tables.is_cuda:
        return upper
    return int(plan.tables[1].sum()), int(plan.tables[3].sum())


@dataclass
class _Fitted:
    """One side's fit, on the device: what encode projects on and what the layer blobs store."""

    shape: tuple[int, int, int, int]   # L, H, T, d
    B: int
    D: int
    mean_st: torch.Tensor      # [L, B, D] the stored means (fp16, or fp32 with an fp32 basis)
    bits: torch.Tensor         # [L, B, D] int64: each component's bits
    solved: torch.Tensor       # [L, B] bool: the eigensolver converged
    row_bits: torch.Tensor     # [L, B*D] int64: bits of the stored column in each basis row (0: none)
    basis: torch.Tensor        # [L, B, D, D] float32: row (l, b, j) = block b's j-th stored column, as decoded
    stored: dict               # the basis as stored: int formats {"packed", "scale", "min", "plan"}, else {"rows"}


def _stored_basis(U: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """U [L, B, D, D] (column i = component i), bits [L, B, D] -> the stored columns as rows, block by
    block in component order (row_bits [L, B*D], rows [L, B, D, D]; rows past a block's last stored
    column are zero), by a scatter on the device."""
    L, B, D, _ = U.shape
    sel = bits > 0
    slot = torch.where(sel, sel.long().cumsum(2) - 1, torch.full_like(bits, D))   # slot D: dropped
    rows = torch.zeros(L, B, D + 1, D, dtype=torch.float32, device=U.device)
    rows.scatter_(2, slot[..., None].expand(L, B, D, D), U.transpose(2, 3).float())
    row_bits = torch.zeros(L, B, D + 1, dtype=torch.int64, device=U.device).scatter_(2, slot, bits)
    return row_bits[:, :, :D].reshape(L, B * D).contiguous(), rows[:, :, :D].contiguous()


def _quantize_basis(rows: torch.Tensor, row_bits: torch.Tensor, s: CodecSettings) -> tuple[torch.Tensor, dict]:
    """The stored basis (codec._basis: int formats quantize each column of D values, min/max) and
    what encode projects on (the decoded basis), in one launch for every layer."""
    L, B, D, _ = rows.shape
    if not s.basis_fmt.startswith("int"):
        stored = rows.to(codec.FLOAT_FORMATS[s.basis_fmt])
        return stored.float(), {"rows": stored}
    bb = INT_FORMATS[s.basis_fmt]
    dev = rows.device
    rb = torch.where(row_bits > 0, bb, 0)
    ng, gs, groups = _to_dev(dev, torch.ones(1, dtype=torch.long), torch.tensor([D]), torch.tensor([[0, 0, 0, D]]))
    plan = _plan(rb, ng, gs, bb)
    n_bytes, n_sc = _run_sizes(plan, (L * B * D * D * bb // 8 + L, L * B * D))
    flat = rows.view(L * B * D, D)
    deq = torch.zeros_like(flat)
    packed, scale, mn = quantize_plan(flat, rb.view(-1), plan.base_bit, plan.base_sc, groups, "minmax",
                                      n_bytes, n_sc, whole_bytes=(D * bb) % 8 == 0, deq=deq)
    return deq.view(L, B, D, D), {"packed": packed, "scale": scale, "min": mn, "plan": plan}


def _fit_launch(sides: dict[str, tuple[torch.Tensor, float]], s: CodecSettings, clock: _Clock) -> dict[str, _Fitted]:
    """Queue both sides' fits (X: [L, H, T, d] float32 on the device): the Grams, then on the fit
    stream one batched eigendecomposition for every block of both sides (cuSOLVER: 2 x 28 512x512
    matrices in 20-23 ms on an H200, one side alone 15-16), the bit allocations, the stored bases
    and their quantization. Nothing here waits for the device."""
    means, grams, shapes = {}, [], {}
    with _tf32(clock.dev):
        for prefix, (X, _) in sides.items():
            if s.joint_heads and X.is_cuda:
                means[prefix], G = _joint_gram_fused(X, s.center)
                B, D = 1, X.shape[1] * X.shape[3]
            else:
                Xb, B, D = _blocks(X, s)
                means[prefix], G = centered_gram(Xb, center=s.center)              # [L*B, D], [L*B, D, D]
                del Xb
            grams.append(G)
            shapes[prefix] = (X.shape, B, D)
    mean_fmt = codec.FLOAT_FORMATS["fp32" if s.basis_fmt == "fp32" else "fp16"]
    # the stored means (what encode subtracts), made here on the caller's stream: the caller's
    # gather uses them before it waits for the fit stream
    mean_st = {prefix: means[prefix].reshape(-1, B, D).to(mean_fmt) for prefix, (_, B, D) in shapes.items()}
    G_all = torch.cat(grams) if len(grams) > 1 else grams[0]
    del grams
    out, at = {}, 0
    with _on_fit_stream(clock.dev) as st:
        if st is not None:
            G_all.record_stream(st)
        evals_all, U_all = eigh_desc(G_all)
        clock.lap("fit: gram + eigh")
        for prefix, (X, bpe) in sides.items():
            (L, H, T, d), B, D = shapes[prefix]
            evals = evals_all[at:at + L * B].clamp_min(0).float()
            U = U_all[at:at + L * B].float()
            at += L * B
            n_parts = max(1, math.ceil(T / max(1, s.part_tokens)))
            budget = (bpe * H * T * d - B * D * (16 + 8) - 8 * 450 - n_parts * 8 * 160 - s.sink_tokens * H * d * 16)
            bits = allocate_bits_batched(evals.reshape(L, B, D), [budget] * L, T, D, s)   # [L, B, D]
            solved = torch.isfinite(evals).all(dim=1).reshape(L, B)
            row_bits, rows = _stored_basis(U.view(L, B, D, D), bits)
            basis, stored = _quantize_basis(rows, row_bits, s)
            out[prefix] = f = _Fitted((L, H, T, d), B, D, mean_st[prefix], bits, solved, row_bits, basis, stored)
            if st is not None:   # made on the fit stream, used on the caller's after _join_fit
                main = torch.cuda.current_stream(clock.dev)
                for t in [f.bits, f.solved, f.row_bits, f.basis] + [v for v in stored.values() if torch.is_tensor(v)]:
                    t.record_stream(main)
        clock.lap("fit: bits + basis")
    return out


_FIT_STREAMS: dict = {}


@contextlib.contextmanager
def _on_fit_stream(dev: torch.device):
    """On a GPU: the work inside runs on a side stream that starts after everything queued so far;
    the caller's stream waits for it at :func:`_join_fit` (meanwhile the caller queues the tokens'
    gather, which does not need the eigenvectors). Elsewhere: no stream (yields None)."""
    if dev.type != "cuda":
        yield None
        return
    st = _FIT_STREAMS.get(dev)
    if st is None:
        st = _FIT_STREAMS[dev] = torch.cuda.Stream(device=dev)
    st.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(st):
        yield st


def _join_fit(dev: torch.device) -> None:
    if dev.type == "cuda" and dev in _FIT_STREAMS:
        torch.cuda.current_stream(dev).wait_stream(_FIT_STREAMS[dev])


def _joint_gram_fused(X: torch.Tensor, center: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """centered_gram of the joint-head blocks of X [L, H, T, d] (fp32, CUDA) with the head
    interleave and the centering in one pass (a permuted copy, then a centered one, before)."""
    L, H, T, d = X.shape
    mean = X.mean(dim=2) if center else X.new_zeros(L, H, d)                      # [L, H, d]
    Xc = torch.empty(L, T, H, d, dtype=X.dtype, device=X.device)
    torch.sub(X.permute(0, 2, 1, 3), mean[:, None], out=Xc)
    Xc = Xc.view(L, T, H * d)
    return mean.reshape(L, H * d), Xc.transpose(1, 2) @ Xc / max(1, T)


@contextlib.contextmanager
def _tf32(dev: torch.device):
    """fp32 matmuls on TF32 tensor cores inside (CUDA only): the Gram and the projection. Inputs
    round to 10-bit mantissas, unbiasedly, so over thousands of tokens the Gram moves by ~1e-5 of
    its scale and a coefficient by ~3e-4 of its norm, far under the finest quantization step
    kept (8 bits: 1/255 of a group's range)."""
    if dev.type != "cuda":
        yield
        return
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _host_async(*ts: torch.Tensor) -> tuple:
    """Host copies of device tensors, ready once the returned event is (last item; None on the CPU)."""
    if not ts[0].is_cuda:
        return ts + (None,)
    bufs = []
    for t in ts:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        bufs.append(buf)
    ev = torch.cuda.Event()
    ev.record()
    return tuple(bufs) + (ev,)


# --------------------------------------------------------------------------------------------
# encode


@dataclass
class _Layout:
    """Where every cluster's tokens sit on the projection's token axis (host-side plan, device indices).

    Cluster c takes ``ng[c]`` groups of ``gs[c]`` columns (gs = the group size, or the cluster's size
    when smaller): its tokens in order, then copies of its last token up to a whole group."""

    forced: list[torch.Tensor]              # per cluster: local rows of its sinks (host)
    perm: torch.Tensor                      # [P] the token of each column (device)
    ng: torch.Tensor                        # [C] groups per row of each cluster (device)
    gs: torch.Tensor                        # [C] group size of each cluster (device)
    groups: torch.Tensor                    # [G, 4] (cluster, group, first column, size) of every group (device)
    whole_bytes: bool                       # every group size a multiple of 8: groups own whole bytes
    pad_dst: torch.Tensor | None            # padding columns and the columns they repeat (device)
    pad_src: torch.Tensor | None
    sink: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]   # c -> (sink tokens, their columns, kept columns)

    @property
    def n_columns(self) -> int:
        return self.perm.numel()


def _layout(sets: list[torch.Tensor], s: CodecSettings, dev: torch.device) -> _Layout:
    forced = [torch.nonzero(t < s.sink_tokens).flatten() for t in sets]       # per cluster, local rows
    C = len(sets)
    ng, gsz = torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.long)
    perm, pad_dst, pad_src, groups = [], [], [], []
    sink_h: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    P = 0
    for c, t_set in enumerate(sets):
        Tc = int(t_set.numel())
        if not Tc:
            continue
        gs = Tc if s.group_size <= 0 or s.group_size >= Tc else s.group_size
        padded = -(-Tc // gs) * gs
        ng[c], gsz[c] = padded // gs, gs
        g = torch.arange(padded // gs)
        groups.append(torch.stack([torch.full_like(g, c), g, P + g * gs, torch.full_like(g, gs)], dim=1))
        perm += [t_set, t_set[-1:].expand(padded - Tc)]
        if padded > Tc:
            pad_dst.append(torch.arange(P + Tc, P + padded))
            pad_src.append(torch.full((padded - Tc,), P + Tc - 1, dtype=torch.long))
        f = forced[c]
        if f.numel():
            keep = torch.ones(Tc, dtype=torch.bool)
            keep[f] = False
            sink_h.append((c, t_set[f], f + P, keep.nonzero().flatten() + P))
        P += padded
    flat = [torch.cat(perm) if perm else torch.zeros(0, dtype=torch.long), ng, gsz,
            torch.cat(groups) if groups else torch.zeros(0, 4, dtype=torch.long)]
    if pad_dst:
        flat += [torch.cat(pad_dst), torch.cat(pad_src)]
    for _, pos, cols, kept in sink_h:
        flat += [pos, cols, kept]
    d = _to_dev(dev, *flat)   # one asynchronous copy
    k = 6 if pad_dst else 4
    sink = {c: tuple(d[k + 3 * i:k + 3 * i + 3]) for i, (c, *_) in enumerate(sink_h)}
    return _Layout(forced=forced, perm=d[0], ng=d[1], gs=d[2], groups=d[3],
                   whole_bytes=all(int(x) % 8 == 0 for x in gsz if x),
                   pad_dst=d[4] if pad_dst else None, pad_src=d[5] if pad_dst else None, sink=sink)


def _gather_center(X: torch.Tensor, mean_st: torch.Tensor, lay: _Layout, clock: _Clock) -> torch.Tensor:
    """The tokens in part order, each part padded to whole groups (a gather of d-value rows), minus
    the stored mean: [L, P, H*d] for joint heads (interleaved by the gather), else [L, H, P, d]."""
    L, H, T, d = X.shape
    mean16 = mean_st.float()                                                  # [L, B, D]
    if mean_st.shape[1] == 1:
        Xs = X.permute(0, 2, 1, 3).index_select(1, lay.perm).view(L, -1, H * d)
        Xs.sub_(mean16.view(L, 1, H * d))
    else:
        Xs = X.index_select(2, lay.perm)
        Xs.sub_(mean16.view(L, H, 1, d))
    clock.lap("encode: gather + center")
    return Xs


def _encode_side(prefix: str, X: torch.Tensor, Xs: torch.Tensor, fit: _Fitted, plan: _Plan, lay: _Layout,
                 s: CodecSettings, clock: _Clock, out_x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project one side's tokens (Xs from :func:`_gather_center`) on its decoded basis (every part
    at once), replace the sinks' and the padding's coefficients, and quantize every stored row at
    its width in one launch as ``plan`` lays it out: (codes, scale, min) on the device."""
    L, H, T, d = X.shape
    with _tf32(X.device):
        if fit.B == 1:   # joint heads: one block of H*d dims
            Y = torch.matmul(fit.basis[:, 0], Xs.transpose(1, 2))            # [L, D, P]
        else:            # per head: a batched matmul per (layer, head) over d dims
            Y = torch.matmul(fit.basis, Xs.transpose(2, 3))                  # [L, H, D, P]
    del Xs
    P = Y.shape[-1]
    Y = Y.reshape(-1, P)                                                       # rows: fit.row_bits
    clock.lap("encode: project")
    # the attention sinks: kept in fp16, their coefficients replaced by their part's mean (codec.encode)
    for c, (pos, cols, kept) in lay.sink.items():
        out_x[(prefix, c)] = X[:, :, pos, :].to(torch.float16)                # [L, H, n, d]
        if kept.numel():
            Y[:, cols] = Y[:, kept].mean(dim=1, keepdim=True)
    if lay.pad_dst is not None:   # a padding column repeats its part's last coefficient (after the sinks)
        Y[:, lay.pad_dst] = Y[:, lay.pad_src]
    clock.lap("encode: sinks + padding")
    n_rows, G = Y.shape[0], lay.groups.shape[0]
    sizes = _run_sizes(plan, (n_rows * P * s.max_bits // 8 + L * lay.ng.numel() * (s.max_bits + 1), n_rows * G))
    out = quantize_plan(Y, fit.row_bits.view(-1), plan.base_bit, plan.base_sc, lay.groups, s.range_mode, *sizes,
                        whole_bytes=lay.whole_bytes)
    clock.lap("encode: quantize")
    return out


def _partition(token_sets, T: int) -> list[torch.Tensor]:
    sets = [torch.as_tensor(t, dtype=torch.long).reshape(-1).cpu() for t in token_sets]
    perm = torch.cat(sets) if sets else torch.zeros(0, dtype=torch.long)
    if perm.numel() != T or not torch.equal(torch.sort(perm).values, torch.arange(T)):
        raise ValueError("token_sets must partition the document's tokens")
    return sets


# --------------------------------------------------------------------------------------------
# the host side: copies back and the codec's byte format


@dataclass
class _HostSide:
    """One side on the host (numpy; the arrays behind the copies are valid after _host_sync)."""

    B: int
    D: int
    bits: np.ndarray          # [L, B, D] int64
    row_bits: np.ndarray      # [L, B*D] int64
    tables: np.ndarray        # [4, L, C, W] the coefficient runs (first byte, bytes, first scale, scales)
    basis_tables: np.ndarray | None   # [4, L, 1, W] the int basis' runs
    mean: np.ndarray = None   # [L, bytes]
    codes: tuple = ()         # (packed, scale, min) as uint8
    basis: tuple = ()         # int formats: (packed, scale, min) as uint8; float formats: (rows,)

    def rank(self, layer: int) -> int:
        return int((self.row_bits[layer] > 0).sum())


def _event(dev: torch.device):
    if dev.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def _copy_back(fit: _Fitted, codes: tuple, hs: _HostSide, done) -> None:
    """Queue one side's host copies of exactly the bytes the tables say it wrote, once ``done``."""
    n_bytes, n_sc = int(hs.tables[1].sum()), int(hs.tables[3].sum())
    packed, scale, mn = codes
    hs.codes = tuple(_to_host([packed[:n_bytes], scale[:n_sc].view(torch.uint8), mn[:n_sc].view(torch.uint8)],
                              after=done))
    st = fit.stored
    if hs.basis_tables is not None:
        nb, ns = int(hs.basis_tables[1].sum()), int(hs.basis_tables[3].sum())
        hs.basis = tuple(_to_host([st["packed"][:nb], st["scale"][:ns].view(torch.uint8),
                                   st["min"][:ns].view(torch.uint8)], after=done))
    else:
        hs.basis = tuple(_to_host([st["rows"].contiguous().view(torch.uint8)], after=done))
    hs.mean = _to_host([fit.mean_st.contiguous().view(torch.uint8)], after=done)[0].reshape(fit.shape[0], -1)


def _layer_blob(layer: int, sides: dict[str, _HostSide], s: CodecSettings, H: int, d: int, T: int) -> bytes:
    """The 'L{layer}' blob (codec.to_bytes of the layer's LayerCodec)."""
    meta = {"settings": s.to_json(), "H": H, "d": d, "T_fit": T}
    table = []
    for prefix, hs in sides.items():
        B, D, R = hs.B, hs.D, hs.rank(layer)
        table.append((f"{prefix}.mean", "f32" if s.basis_fmt == "fp32" else "f16", [B, D], hs.mean[layer]))
        if hs.basis_tables is not None:
            first, nbytes, first_sc, nsc = hs.basis_tables[:, layer, 0, INT_FORMATS[s.basis_fmt]]
            packed, scale, mn = hs.basis
            table += [(f"{prefix}.basis.codes", "u8", [int(nbytes)], packed[first:first + nbytes]),
                      (f"{prefix}.basis.scale", "f16", [R], scale[2 * first_sc:2 * (first_sc + nsc)]),
                      (f"{prefix}.basis.min", "f16", [R], mn[2 * first_sc:2 * (first_sc + nsc)])]
            meta[f"{prefix}.basis"] = {"fmt": s.basis_fmt, "shape": [D, R], "group_size": D, "axis": -2,
                                       "n": R * D, "padded_cols": D}
        else:   # the stored columns as a [D, R] matrix
            rows = hs.basis[0].reshape(hs.row_bits.shape[0], B * D, D, -1)[layer][hs.row_bits[layer] > 0]
            dt = codec.FLOAT_FORMATS[s.basis_fmt]
            table.append((f"{prefix}.basis", codec._DTYPE_NAMES[dt], [D, R],
                          np.ascontiguousarray(rows.transpose(1, 0, 2)).tobytes()))
        b = hs.bits[layer]
        table.append((f"{prefix}.bits", "u8", [B, D], b.astype(np.uint8).tobytes()))
        meta[prefix] = {"mode": "pca", "blocks": B, "dim": D, "rank_max": int((b > 0).sum(axis=1).max()) if b.size else 0}
    return _blob_bytes(meta, table)


def _part_blob(layer: int, c: int, Tc: int, prefix: str, hs: _HostSide, out_x: dict, forced: torch.Tensor) -> bytes:
    """The part blob of cluster c, one side (codec.to_bytes of codec.encode's Blob)."""
    table = []
    if not hs.rank(layer):
        return _blob_bytes({"T": Tc}, table)
    if (prefix, c) in out_x:
        it = torch.int32 if Tc > 32767 else torch.int16
        table.append(("out.idx", codec._DTYPE_NAMES[it], [forced.numel()], forced.to(it).numpy().tobytes()))
        xh, shape = out_x[(prefix, c)]
        table.append(("out.x", "f16", list(shape[1:]), xh.reshape(shape[0], -1)[layer]))   # [H, n, d] fp16
    first, nbytes, first_sc, nsc = hs.tables[:, layer, c]     # [W] each: the part's runs, widths ascending
    a, b = int(first[0]), int(first[-1] + nbytes[-1])
    sa, sb = int(first_sc[0]), int(first_sc[-1] + nsc[-1])
    packed, scale, mn = hs.codes
    table += [("codes", "u8", [b - a], packed[a:b]), ("scale", "f16", [sb - sa], scale[2 * sa:2 * sb]),
              ("min", "f16", [sb - sa], mn[2 * sa:2 * sb])]
    return _blob_bytes({"T": Tc}, table)


def encode_state(keys_pre: torch.Tensor | list[torch.Tensor], values: torch.Tensor | list[torch.Tensor],
                 token_sets: list[torch.Tensor] | Callable[[], list[torch.Tensor]],
                 settings: CodecSettings | str | float | None = None, *,
                 device: torch.device | str | None = None, sync_timings: bool = False) -> EncodedState:
    """Fit and encode a whole document: keys (pre-RoPE) and values [L, H, T, d] (or per-layer lists),
    clusters given as token index sets (a partition of range(T), each ascending).

    ``token_sets`` may be a function that returns them: the fit does not need the clusters, so it is
    called once the fit is queued, and the caller's clustering runs on the host while the GPU fits.

    Every part keeps the attention sinks (positions < ``sink_tokens``) in fp16, as
    ``codec.encode(..., positions)`` does. ``sync_timings`` synchronizes the device between stages so
    ``timings_ms`` splits the time by stage (off: one figure per stage, host-side only).
    """
    s = settings_for(settings)
    if not supports(s):
        raise ValueError(f"the batched codec takes pca keys and values without outliers, not {s.name}")
    if isinstance(keys_pre, (list, tuple)):
        dev0 = keys_pre[0].device
    else:
        dev0 = keys_pre.device
    dev = torch.device(device) if device is not None else dev0
    clock = _Clock(dev, sync_timings)
    K = torch.stack(list(keys_pre)).to(dev, torch.float32) if isinstance(keys_pre, (list, tuple)) \
        else keys_pre.to(dev, torch.float32)
    V = torch.stack(list(values)).to(dev, torch.float32) if isinstance(values, (list, tuple)) \
        else values.to(dev, torch.float32)
    if K.dim() != 4 or K.shape != V.shape:
        raise ValueError(f"keys and values must both be [L, H, T, d], got {tuple(K.shape)} and {tuple(V.shape)}")
    L, H, T, d = K.shape
    if not callable(token_sets):
        sets = _partition(token_sets, T)
    clock.lap("move")
    fits = _fit_launch({"k": (K, s.k_bits), "v": (V, s.v_bits)}, s, clock)
    if callable(token_sets):
        sets = _partition(token_sets(), T)
        clock.lap("cluster (caller's)")
    lay = _layout(sets, s, dev)   # host work while the eigensolver runs
    # the tokens gathered and centered while the eigensolver runs on its stream
    gathered = {prefix: _gather_center(X, fits[prefix].mean_st, lay, clock) for prefix, X in (("k", K), ("v", V))}
    _join_fit(dev)
    plans = {prefix: _plan(f.row_bits, lay.ng, lay.gs, s.max_bits) for prefix, f in fits.items()}
    small = []
    for prefix, f in fits.items():
        small += [f.bits, f.solved, f.row_bits, plans[prefix].tables]
        if "plan" in f.stored:
            small.append(f.stored["plan"].tables)
    *small_h, tables_ready = _host_async(*small)
    clock.lap("encode: plan")
    # the side with more bits first: its codes go to the host while the other side is encoded
    order = [("v", V), ("k", K)] if s.v_bits >= s.k_bits else [("k", K), ("v", V)]
    coded, done, out_x = {}, {}, {}
    for prefix, X in order:
        coded[prefix] = _encode_side(prefix, X, gathered.pop(prefix), fits[prefix], plans[prefix], lay, s, clock, out_x)
        done[prefix] = _event(dev)
    # the one wait for the device before the end: the bit allocations and the plans' sizes (the
    # encode queued above keeps the device busy meanwhile), then copies of exactly what was written
    if tables_ready is not None:
        tables_ready.synchronize()
    small_h = iter(t.numpy() for t in small_h)
    host: dict[str, _HostSide] = {}
    for prefix, f in fits.items():
        bits_h, solved_h, row_bits_h, tables_h = (next(small_h) for _ in range(4))
        if not solved_h.all():
            bad = sorted({int(i) for i in np.nonzero(~solved_h)[0]})
            raise KiteError(f"the eigensolver did not converge on the {prefix} Gram of layer(s) {bad} "
                            "(non-finite KV values?)")
        host[prefix] = _HostSide(f.B, f.D, bits_h, row_bits_h, tables_h,
                                 next(small_h) if "plan" in f.stored else None)
    for prefix, _ in order:   # the copy stream runs in order: first done, first copied
        _copy_back(fits[prefix], coded[prefix], host[prefix], done[prefix])
    xs = list(out_x.items())
    out_x_h = {k: (h, v.shape) for (k, v), h in zip(xs, _to_host([v.contiguous().view(torch.uint8) for _, v in xs]))}
    _host_sync(dev)
    clock.lap("encode: wait for the host copies")

    layer_blobs = [_layer_blob(layer, host, s, H, d, T) for layer in range(L)]
    clock.lap("fit: layer blobs")
    part_blobs = [[tuple(_part_blob(layer, c, int(t_set.numel()), prefix, host[prefix], out_x_h, lay.forced[c])
                         for prefix in ("k", "v"))
                   for c, t_set in enumerate(sets)] for layer in range(L)]
    clock.lap("serialize")
    info = {f"R_{prefix}": [hs.rank(layer) for layer in range(L)] for prefix, hs in host.items()}
    return EncodedState(layer_blobs=layer_blobs, part_blobs=part_blobs,
                        timings_ms={k: round(v, 3) for k, v in clock.times.items()}, info=info)
