"""Split-KV attention for a short query after a long cached prefix (flash-decoding), in Triton.

A first forward over a loaded state has few query rows (16 tokens x the query heads of one KV head,
folded: 112 rows at Qwen2-7B's 7:1 grouping) and many keys (16K). A flash kernel that gives each
thread block a tile of query rows then runs only a handful of blocks, each walking every key. Here
the keys are split into chunks across blocks instead: block (split, row tile, sequence x KV head)
attends its rows to its chunk of keys and writes a partial output (normalized over its chunk) and the
log-sum-exp of its scores; a second kernel merges the chunks' partials exactly, by their log-sum-exp
(one program per query row, every chunk's partial loaded at once), and writes the output in the
layout the model wants ([B, q, Hq, d]).

The query heads of a KV head share each key / value tile (grouped-query attention: no copies of K/V
per query head). A key is visible to a query row where the boolean mask says so ([B|1, 1, q, k],
any strides); without a mask, the bottom-right causal rule: key j is visible to query token t when
j <= k - q + t (every cached token precedes the query, which is causal within itself).

Both kernels are plain launches with shapes fixed by the inputs, so a forward that calls them can be
captured in a CUDA graph. The query's length is an argument, not a compile-time constant (only the
folded rows' tile is): as a constant, each new length of a continuation after a state compiled both
kernels anew, and a training run's held-back documents and held-out pairs come in many lengths.
Triton's interpreter (TRITON_INTERPRET=1) runs them on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NUM_WARPS, NUM_STAGES = 8, 2     # the partial kernel's launch configuration
# ... for calls by row (a batch cache's steps) whose folded query rows fill one tile of 16 (a decode
# step, a question of 2 tokens at Qwen2-7B's 7:1 grouping): keys a tile, warps, stages. On the H200 a
# graphed step of 32 rows x 16K keys took 11.87 ms at (128, 4, 2) against 12.42 ms at the (64, 8, 2) of
# wider tiles in one sweep (benchmarks/batch_step_gpu.py --attention-configs; that run's log, its result
# file was not written), 12.24 ms in batch_step_gpu_h200_20261203_fb9441f.json. Wider tiles (a
# question's prefill) keep (64, NUM_WARPS, NUM_STAGES).
ROW_BLOCK_N, ROW_WARPS, ROW_STAGES = 128, 4, 2
BY_ROW_BLOCKS_PER_SM = 16
_SMS: dict[int, int] = {}


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, rows_ptr, lens_ptr, starts_ptr, o_ptr, lse_ptr, qk_scale, KL,
                    CHUNK, sqb, sqh, sqt, skb, skh, skn, svb, svh, svn, smb, smt, smn,
                    SPLITS, QL, HKV: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_MASK: tl.constexpr, HAS_LENS: tl.constexpr, IEEE: tl.constexpr):
    split = tl.program_id(0)
    mt = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // HKV
    g = bh % HKV
    M = REP * QL
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)     # folded row r*QL + t: query head g*REP + r, token t
    row_ok = rows < M
    r = rows // QL
    t = rows % QL
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + (g * REP + r)[:, None] * sqh + t[:, None] * sqt + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if HAS_LENS:     # per sequence: the buffer row it reads, its visible keys, where its new tokens start
        kv_b = tl.load(rows_ptr + b).to(tl.int64)
        kl = tl.load(lens_ptr + b)
        last = tl.load(starts_ptr + b)              # key j visible to token t iff j < kl and j <= last + t
    else:
        kv_b = b.to(tl.int64)
        kl = KL
        last = KL - QL                              # causal rule: key j visible to token t iff j <= last + t
    kb = k_ptr + kv_b * skb + g.to(tl.int64) * skh
    vb = v_ptr + kv_b * svb + g.to(tl.int64) * svh
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, kl)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + n
        col_ok = cols < hi
        k = tl.load(kb + cols.to(tl.int64)[None, :] * skn + d[:, None], mask=col_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * qk_scale     # [BLOCK_M, BLOCK_N], log2 units
        else:
            s = tl.dot(q, k) * qk_scale
        vis = col_ok[None, :] & row_ok[:, None]
        if HAS_MASK:
            mv = tl.load(mask_ptr + b.to(tl.int64) * smb + t[:, None] * smt + cols.to(tl.int64)[None, :] * smn,
                         mask=vis, other=0)
            vis = vis & (mv != 0)
        else:
            vis = vis & (cols[None, :] <= last + t[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vb + cols.to(tl.int64)[:, None] * svn + d[None, :], mask=col_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))   # log2 units
    part = (bh * SPLITS + split).to(tl.int64) * M
    tl.store(o_ptr + (part + rows)[:, None] * D + d[None, :], out, mask=row_ok[:, None])
    tl.store(lse_ptr + part + rows, lse, mask=row_ok)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, lse_out_ptr, sob, sot, soh, SPLITS, QL,
                  HKV: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
                  SP: tl.constexpr, HAS_LSE: tl.constexpr):
    # one program per folded row: every split's partial loaded at once ([SP, D]), no serial chain of loads
    row = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    g = bh % HKV
    M = REP * QL
    s = tl.arange(0, SP)
    s_ok = s < SPLITS
    d = tl.arange(0, D)
    part = (bh * SPLITS + s).to(tl.int64) * M + row
    lse = tl.load(lse_ptr + part, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    total = tl.sum(w, 0)
    o = tl.load(o_ptr + part[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    r = row // QL
    t = row % QL
    tl.store(out_ptr + b.to(tl.int64) * sob + t * sot + (g * REP + r) * soh + d, out.to(out_ptr.dtype.element_ty))
    if HAS_LSE:     # [B, Hq, QL], natural log: -inf where the row saw no key
        lse_all = tl.where(total > 0, (top + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_out_ptr + (b.to(tl.int64) * HKV * REP + g * REP + r) * QL + t, lse_all)


def _sms(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def plan(batch: int, hkv: int, rows: int, keys: int, sms: int, block_n: int = 64) -> tuple[int, int, int]:
    """(BLOCK_M, splits, keys per split): enough blocks for one block per SM, each split at least two
    key tiles long and a whole number of tiles; all the folded rows in one tile (up to 128)."""
    block_m = _block_m(rows)
    tiles_m = triton.cdiv(rows, block_m)
    want = max(1, sms // (batch * hkv * tiles_m))
    splits = max(1, min(want, 128, keys // (2 * block_n)))
    chunk = triton.cdiv(triton.cdiv(keys, splits), block_n) * block_n
    return block_m, triton.cdiv(keys, chunk), chunk


def compile_variant(n_split: int) -> tuple[int, bool, bool]:
    """What a call that cuts its keys into ``n_split`` chunks is compiled for, beyond its shapes: the
    merge kernel's power of two of chunks (``SP``) and Triton's int specialisations of the count."""
    return _merge_width(n_split), n_split == 1, n_split % 16 == 0


def _merge_width(n_split: int) -> int:
    return max(2, triton.next_power_of_2(n_split))


def launch(rows: int, by_row: bool) -> tuple[int, int, int]:
    """(keys a tile, warps, stages) of a call whose query heads of a KV head and tokens fold into
    ``rows`` rows: ROW_* by row at one tile of 16 rows, else 64 keys at NUM_WARPS, NUM_STAGES."""
    if by_row and _block_m(rows) == 16:
        return ROW_BLOCK_N, ROW_WARPS, ROW_STAGES
    return 64, NUM_WARPS, NUM_STAGES


def _block_m(rows: int) -> int:
    return max(16, min(128, triton.next_power_of_2(rows)))


def _call_plan(batch: int, hkv: int, rows: int, keys: int, device: torch.device, by_row: bool,
               block_n: int) -> tuple[int, int, int]:
    """:func:`plan` as :func:`split_kv_attention` makes it on ``device``: rows of a batch cache get blocks
    for ~16 programs an SM (a graphed decode step of 32 rows x 16K keys on the H200 took 17.0 ms at the
    one-a-SM plan, 12.5 ms at 16: benchmarks/batch_step_gpu.py --splits)."""
    sms = _sms(device) if device.type == "cuda" else 4
    return plan(batch, hkv, rows, keys, sms * (BY_ROW_BLOCKS_PER_SM if by_row else 1), block_n)


def row_splits(batch: int, q_heads: int, kv_heads: int, query_len: int, keys: int, device: torch.device) -> int:
    """The chunks a by-row call (``lengths`` given, no ``splits``) cuts ``keys`` into for ``batch``
    sequences: a batch of a new size costs a compile where it lands in a new :func:`compile_variant`."""
    rows = (q_heads // kv_heads) * query_len
    return _call_plan(batch, kv_heads, rows, keys, device, True, launch(rows, True)[0])[1]


def split_kv_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: torch.Tensor | None = None, scale: float | None = None, *,
                       splits: int | None = None, block_n: int | None = None, rows: torch.Tensor | None = None,
                       lengths: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                       return_lse: bool = False):
    """Attention of query [B, Hq, q, d] over key / value [B, Hkv, k, d] (Hq a multiple of Hkv, d a power
    of two >= 16): out [B, q, Hq, d] in the query's dtype.

    ``mask``: bool [B|1, 1, q, k], True = visible; None = bottom-right causal. A query row that sees no
    key gets zeros. ``splits``: how many chunks the keys are cut into (default: one block per SM, at
    most 128 chunks; on the CPU, as for 4 SMs); ``block_n``: keys a tile (default: :func:`launch`'s).

    Sequences of different lengths in one buffer (a batch cache): ``rows`` [B] int32, the buffer row
    (first index of key / value, which then may hold more rows than B) sequence b reads; ``lengths``
    [B] int32, its filled keys (its new tokens' included); ``starts`` [B] int32, the slot of its first
    new token: key j is visible to its token t iff j < lengths[b] and j <= starts[b] + t (padded
    tokens past a sequence's own see what its last one sees; a sequence of length 0 gets zeros). No
    mask then; the chunks are cut for the buffer's capacity, so the launch does not depend on the
    lengths (a CUDA graph replays it for any). ``return_lse``: also the log-sum-exp of each query
    row's scores, [B, Hq, q] float32 (natural log; -inf where nothing is visible), for merging with
    another part (kite.kernels.partials.merge).
    """
    B, Hq, QL, D = query.shape
    Hkv, KL = key.shape[1], key.shape[2]
    rep = Hq // Hkv
    M = rep * QL
    scale = D ** -0.5 if scale is None else scale
    by_row = lengths is not None
    if by_row and (mask is not None or rows is None or starts is None):
        raise ValueError("lengths come with rows and starts, and without a mask")
    tile, warps, stages = launch(M, by_row)
    block_n = block_n or tile
    block_m, n_split, chunk = _call_plan(B, Hkv, M, KL, query.device, by_row, block_n)
    if splits is not None:
        chunk = triton.cdiv(triton.cdiv(KL, max(1, splits)), block_n) * block_n
        n_split = triton.cdiv(KL, chunk)
    tiles_m = triton.cdiv(M, block_m)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    o_part = torch.empty(B * Hkv * n_split * M * D, dtype=torch.float32, device=query.device)
    lse_part = torch.empty(B * Hkv * n_split * M, dtype=torch.float32, device=query.device)
    if mask is not None:
        mk = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        sm = (mk.stride(0) if mk.shape[0] > 1 else 0, mk.stride(2), mk.stride(3))
    else:
        mk, sm = lse_part, (0, 0, 0)     # not read
    unused = lse_part                    # pointers the kernel does not read
    ieee = query.dtype == torch.float32
    _partial_kernel[(n_split, tiles_m, B * Hkv)](
        query, key, value, mk, rows if by_row else unused, lengths if by_row else unused,
        starts if by_row else unused, o_part, lse_part, scale * LOG2E, KL, chunk,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *sm, n_split, QL,
        HKV=Hkv, REP=rep, D=D, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=mask is not None, HAS_LENS=by_row, IEEE=ieee, num_warps=warps, num_stages=stages)
    out = torch.empty(B, QL, Hq, D, dtype=query.dtype, device=query.device)
    lse = torch.empty(B, Hq, QL, dtype=torch.float32, device=query.device) if return_lse else lse_part
    _merge_kernel[(M, B * Hkv)](
        o_part, lse_part, out, lse, out.stride(0), out.stride(1), out.stride(2), n_split, QL,
        HKV=Hkv, REP=rep, D=D, SP=_merge_width(n_split), HAS_LSE=return_lse,
        num_warps=4)
    return (out, lse) if return_lse else out
