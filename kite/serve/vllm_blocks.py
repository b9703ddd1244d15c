"""Where a KITE state lands in vLLM's paged KV cache (docs/vllm-connector.md), without vLLM.

vLLM keeps a request's KV in fixed-size blocks: token position ``p`` lives in block
``block_ids[p // block_size]`` at slot ``p % block_size`` (flat slot ``block_id * block_size +
p % block_size``). A state covers its document's tokens cluster by cluster (``token_ranges`` in
its header, docs/upc-format.md); vLLM's cache holds a contiguous prefix of the prompt, so a state
supplies the longest prefix of the prompt its loaded clusters cover, in whole blocks (the partial
last block is computed by vLLM), and never the prompt's last token (vLLM computes it for the
first logits). The ids: the prompt is the state's document when the content address's token
digest of its first ``n_tokens`` ids is the address's (:func:`prompt_matches`); each block of a
state is named by :func:`block_key`, the same in every process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kite.errors import BadInput


@dataclass(frozen=True, slots=True)
class SlotRun:
    """Document tokens [start, end) written to block ``block_id`` (the request's
    ``block_index``-th block) from slot ``offset`` on."""

    block_index: int
    block_id: int
    offset: int
    start: int
    end: int

    @property
    def slots(self) -> range:
        return range(self.offset, self.offset + self.end - self.start)


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise BadInput(f"block size {block_size!r}: a whole number ≥ 1")


def covered_prefix(token_ranges: Iterable[Sequence[int]], n_tokens: int) -> int:
    """The length m of the longest prefix [0, m) of the document that the ranges cover (the
    loaded clusters' ``token_ranges``), at most ``n_tokens``."""
    m = 0
    for start, end in sorted((int(a), int(b)) for a, b in token_ranges):
        if start > m:
            break
        m = max(m, end)
    return min(m, n_tokens)


def loadable_tokens(covered: int, prompt_len: int, block_size: int, num_computed: int = 0) -> int:
    """How many tokens the connector offers vLLM beyond the ``num_computed`` vLLM already holds
    (``get_num_new_matched_tokens``): the covered prefix, short of the prompt's last token, in
    whole blocks; 0 when that is not past ``num_computed``."""
    _check_block_size(block_size)
    usable = min(covered, prompt_len - 1)
    aligned = usable - usable % block_size
    return max(0, aligned - num_computed)


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold ``n_tokens`` tokens."""
    _check_block_size(block_size)
    return -(-n_tokens // block_size)


def slot_runs(start: int, end: int, block_ids: Sequence[int], block_size: int) -> list[SlotRun]:
    """Positions [start, end) of the request as runs within its blocks (``block_ids``: its block
    table, block i holding positions [i·block_size, (i+1)·block_size))."""
    _check_block_size(block_size)
    if not 0 <= start <= end:
        raise BadInput(f"token range [{start}, {end}): need 0 ≤ start ≤ end")
    if end > len(block_ids) * block_size:
        raise BadInput(f"token range [{start}, {end}) passes the block table's {len(block_ids)} blocks "
                       f"of {block_size}")
    runs, p = [], start
    while p < end:
        i, off = divmod(p, block_size)
        stop = min(end, (i + 1) * block_size)
        runs.append(SlotRun(i, int(block_ids[i]), off, p, stop))
        p = stop
    return runs


def slot_mapping(start: int, end: int, block_ids: Sequence[int], block_size: int) -> list[int]:
    """vLLM's flat slot of each position in [start, end): ``block_id * block_size + offset``."""
    return [r.block_id * block_size + s for r in slot_runs(start, end, block_ids, block_size) for s in r.slots]


def cluster_runs(clusters: Iterable[dict], block_ids: Sequence[int], block_size: int, start: int,
                 end: int) -> dict[int, list[SlotRun]]:
    """For each cluster (a header's ``clusters[]`` entry: ``id``, ``token_ranges``), the runs its
    tokens inside [start, end) take: where the worker writes that cluster's decoded K and V."""
    out: dict[int, list[SlotRun]] = {}
    for c in clusters:
        runs = []
        for a, b in c["token_ranges"]:
            a, b = max(int(a), start), min(int(b), end)
            if a < b:
                runs += slot_runs(a, b, block_ids, block_size)
        out[int(c["id"])] = runs
    return out


def block_key(address: str, block_index: int, block_size: int) -> str:
    """The name of block ``block_index`` (of ``block_size`` tokens) of the state at content
    ``address``: sha256 over the three, the same in every process and on every machine (no
    path, host or hash seed in it)."""
    _check_block_size(block_size)
    return hashlib.sha256(f"kite-block1\0{address}\0{block_size}\0{block_index}".encode()).hexdigest()



def prompt_matches(prompt_ids: Sequence[int], address: dict) -> int:
    """How many of the prompt's first tokens are the state's document: the state's token count when
    the content address's token digest (:func:`kite.upcycle.tokens_digest`) of the prompt's first
    ``n_tokens`` ids is the address's ``tokens_sha256``, else 0. ``address``: the header's
    ``address`` section (:mod:`kite.upcycle.address`) plus ``n_tokens``."""
    from kite.upcycle import tokens_digest

    n = int(address["n_tokens"])
    if n < 1 or len(prompt_ids) < n:
        return 0
    return n if tokens_digest(prompt_ids[:n]) == address["tokens_sha256"] else 0


def loaded_positions(clusters: Iterable[dict]) -> list[int]:
    """The document position of each token of a load of these clusters (a header's ``clusters[]``
    entries, ``token_ranges``), in the order of the rebuilt prefix's tokens
    (``kite.upcycle.load_prefix``): ascending, tokens of clusters not loaded absent. What
    :func:`scatter_into_blocks` needs to put that prefix's rows in their slots."""
    return sorted({p for c in clusters for a, b in c["token_ranges"] for p in range(int(a), int(b))})


def scatter_into_blocks(side_cache, rows, positions: Sequence[int], block_ids: Sequence[int], block_size: int,
                        layout: str = "NHD") -> int:
    """Write one side (K or V) of one layer's tokens into a paged cache, in place: ``rows``
    ``[H, T, d]`` holds the tokens at document ``positions`` (length T, any order: a load's
    clusters come one after another); ``side_cache`` is that side's buffer ``[num_blocks,
    block_size, H, d]`` (``NHD``) or ``[num_blocks, H, block_size, d]`` (``HND``). Position ``p``
    goes to block ``block_ids[p // block_size]``, slot ``p % block_size``. Cast to the cache's
    dtype; returns the tokens written."""
    import torch

    _check_block_size(block_size)
    if layout not in ("NHD", "HND"):
        raise BadInput(f"cache layout {layout!r}: NHD or HND")
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    if rows.dim() != 3 or rows.shape[1] != pos.numel():
        raise BadInput(f"rows {tuple(rows.shape)}: need [H, {pos.numel()}, d] for {pos.numel()} positions")
    if pos.numel() == 0:
        return 0
    if int(pos.min()) < 0 or int(pos.max()) >= len(block_ids) * block_size:
        raise BadInput(f"positions {int(pos.min())}..{int(pos.max())} pass the block table's {len(block_ids)} "
                       f"blocks of {block_size}")
    if pos.unique().numel() != pos.numel():
        raise BadInput("positions repeat: a token has one slot")
    table = torch.as_tensor([int(b) for b in block_ids], dtype=torch.long)
    blocks, slots = table[pos // block_size].to(side_cache.device), (pos % block_size).to(side_cache.device)
    tokens = rows.permute(1, 0, 2).to(device=side_cache.device, dtype=side_cache.dtype)   # [T, H, d]
    if layout == "NHD":
        side_cache[blocks, slots] = tokens
    else:
        side_cache[blocks, :, slots] = tokens
    return int(pos.numel())


def _slots_of(side_cache, positions: Sequence[int], block_ids: Sequence[int], block_size: int):
    import torch

    _check_block_size(block_size)
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= len(block_ids) * block_size):
        raise BadInput(f"positions {int(pos.min())}..{int(pos.max())} pass the block table's {len(block_ids)} "
                       f"blocks of {block_size}")
    table = torch.as_tensor([int(b) for b in block_ids], dtype=torch.long)
    return pos, table[pos // block_size].to(side_cache.device), (pos % block_size).to(side_cache.device)


def gather_from_blocks(side_cache, positions: Sequence[int], block_ids: Sequence[int], block_size: int,
                       layout: str = "NHD"):
    """The inverse of :func:`scatter_into_blocks`: one side of one layer's tokens at ``positions``
    read out of a paged buffer, as a new tensor ``[H, T, d]`` on the buffer's device."""
    if layout not in ("NHD", "HND"):
        raise BadInput(f"cache layout {layout!r}: NHD or HND")
    _, blocks, slots = _slots_of(side_cache, positions, block_ids, block_size)
    tokens = side_cache[blocks, slots] if layout == "NHD" else side_cache[blocks, :, slots]   # [T, H, d]
    return tokens.permute(1, 0, 2).contiguous()


def kernel_block_table(block_ids: Sequence[int], ratio: int) -> list[int]:
    """A request's block table in kernel blocks when the attention kernel splits each of vLLM's
    blocks into ``ratio`` equal ones (block ``b`` → kernel blocks ``b·ratio … b·ratio + ratio − 1``,
    vLLM's ``group_kernel_blocks``)."""
    if not isinstance(ratio, int) or ratio < 1:
        raise BadInput(f"kernel block ratio {ratio!r}: a whole number ≥ 1")
    return [int(b) * ratio + j for b in block_ids for j in range(ratio)]


# How the K and V of a token share the content axis C of vLLM 0.33's per-layer cache view
# [blocks, heads, block_size, C] (docs/vllm-connector.md, "vLLM 0.33's cache"): by backend name.
# "halves": C = [K (head_size) | V (head_size)]; "rows": the CPU backend's, each (block, head)'s
# memory read as [2·block_size, head_size], the block's K rows then its V rows.
KV_PACKING = {"FLASH_ATTN": "halves", "FLASHINFER": "halves", "TRITON_ATTN": "halves", "FLEX_ATTENTION": "halves",
              "CPU_ATTN": "rows"}


@dataclass(frozen=True)
class PagedLayer:
    """One attention layer's K and V in vLLM's paged cache: ``k``, ``v`` views ``[kernel blocks,
    H, kernel_block, d]`` of the same memory as vLLM's per-layer view (writes go into its cache),
    ``ratio`` kernel blocks per vLLM block."""

    k: object
    v: object
    block_size: int
    ratio: int

    @classmethod
    def of(cls, view, packing: str, head_size: int, block_size: int) -> "PagedLayer":
        """Split vLLM's per-layer view ``[B, H, N, C]`` (any strides: the physical order is the
        KVCacheLayout's) of a backend whose packing is ``packing`` (:data:`KV_PACKING`)."""
        if packing not in ("halves", "rows"):
            raise BadInput(f"KV packing {packing!r}: halves or rows")
        if view.dim() != 4 or view.shape[-1] != 2 * head_size:
            raise BadInput(f"KV cache view {tuple(view.shape)}: need [blocks, heads, block_size, 2·{head_size}] "
                           "(K and V of one head size, unquantized)")
        B, H, N, _ = view.shape
        _check_block_size(block_size)
        if block_size % N:
            raise BadInput(f"kernel block of {N} tokens does not divide vLLM's block of {block_size}")
        if packing == "halves":
            k, v = view[..., :head_size], view[..., head_size:]
        else:
            if not view.is_contiguous():
                raise BadInput("the CPU backend's KV packing needs each layer's cache contiguous (layout LBHNC)")
            k, v = view.view(B, H, 2 * N, head_size).chunk(2, dim=2)
        return cls(k, v, block_size, block_size // N)

    def _table(self, block_ids: Sequence[int]) -> tuple[list[int], int]:
        return kernel_block_table(block_ids, self.ratio), self.block_size // self.ratio

    def write(self, keys, values, positions: Sequence[int], block_ids: Sequence[int]) -> int:
        """Scatter ``keys``, ``values`` [H, T, d] (tokens at ``positions``) into the request's
        blocks (``block_ids``, vLLM's block table); cast to the cache's dtype."""
        table, n = self._table(block_ids)
        scatter_into_blocks(self.k, keys, positions, table, n, "HND")
        return scatter_into_blocks(self.v, values, positions, table, n, "HND")

    def read(self, positions: Sequence[int], block_ids: Sequence[int]):
        """(keys, values) [H, T, d] of the tokens at ``positions``, copied out of the cache."""
        table, n = self._table(block_ids)
        return (gather_from_blocks(self.k, positions, table, n, "HND"),
                gather_from_blocks(self.v, positions, table, n, "HND"))


def to_host(t):
    """``t`` on the host: from a GPU, into pinned memory without waiting (the copy is ordered on the
    current stream; record an event after it and wait on that before reading)."""
    if not t.is_cuda:
        return t
    import torch

    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
