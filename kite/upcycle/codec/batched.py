"""The PCA codec batched over layers and parts, on any device: what the per-layer codec does
(``fit_layer`` per layer, then ``encode`` per (cluster, layer)) in a few large operations, so that
it runs on a GPU without host round trips until the blobs are serialized.

* **fit** (:mod:`.batched_fit`): batched Grams, one eigendecomposition of every block of both
  sides, the bit allocation as a sort (:func:`kite.upcycle.codec.bits.allocate_bits_batched`), the
  stored bases quantized in one launch per side; on a GPU on a side stream, while the caller
  clusters the spans and the tokens are gathered;
* **encode** (:mod:`.batched_encode`): one projection per side over the tokens gathered in part
  order, one launch per side quantizing every stored row at its own width where the plan
  (:func:`kite.upcycle.format.bitlayout.runs_plan`) puts it;
* **host side** (:mod:`.batched_bytes`): the host waits once for the small tables (bit allocations,
  run sizes) while the encode runs, then copies exactly the bytes written on a copy stream (the side
  with more bits is encoded first, so its copy runs while the other side is encoded) and builds the
  blobs from slices.

Nothing between the eigensolver and the codes waits for the host. The blobs are the per-layer
codec's bytes (:mod:`kite.upcycle.format.codec_blob`); results match it up to floating-point
summation order (the eigendecomposition on a GPU is float32; a coefficient near a quantization
boundary may land on the next code). On the CPU with the same kernels they are identical but for a rare
last-place difference of a group's fp16 scale or minimum where the two projections round apart.

Supported: ``k_mode == v_mode == "pca"`` with ``outliers == 0`` (the ``ratio=R`` presets);
:func:`supports` says so, and the caller uses the per-layer codec otherwise. A regenerator's bases
(:mod:`.batched_regen`): an unweighted one choosing by the expected error, with a state-wide budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kite.errors import KiteError
from kite.kernels.streams import StageClock, host_async, host_sync, join_side_stream, record_event, to_host
from kite.upcycle.codec.batched_bytes import HostSide, copy_back, layer_blob, part_blob
from kite.upcycle.codec.batched_encode import encode_side, gather_center, layout, partition
from kite.upcycle.codec.batched_fit import fit_launch, solve_launch
from kite.upcycle.codec.batched_regen import takes
from kite.upcycle.codec.settings import CodecSettings, settings_for
from kite.upcycle.format.bitlayout import runs_plan
from kite.upcycle.format.names import blob_key

__all__ = ["supports", "encode_state", "EncodedState"]


def supports(settings: CodecSettings | str | float | None) -> bool:
    """Whether :func:`encode_state` takes these settings (else use the per-layer codec)."""
    s = settings_for(settings)
    return s.k_mode == "pca" and s.v_mode == "pca" and s.outliers == 0 and s.max_bits <= 8


@dataclass
class EncodedState:
    """Serialized blobs: layer_blobs[l] (the 'L{l}' blob), part_blobs[l][c] = (K blob, V blob)."""

    layer_blobs: list[bytes]
    part_blobs: list[list[tuple[bytes, bytes]]]
    timings_ms: dict[str, float] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def items(self) -> list[tuple[str, bytes]]:
        """Every blob under its key, in compress_document's order."""
        items = []
        for layer, lb in enumerate(self.layer_blobs):
            items.append((blob_key(None, layer), lb))
            for c, (kb, vb) in enumerate(self.part_blobs[layer]):
                items += [(blob_key(c, layer, "K"), kb), (blob_key(c, layer, "V"), vb)]
        return items

    def add_to(self, writer) -> None:
        """Add every blob to a StateWriter in compress_document's order (zstd tried in a thread pool)."""
        writer.add_many(self.items())

    def nbytes(self) -> int:
        return sum(len(b) for b in self.layer_blobs) + sum(len(k) + len(v) for p in self.part_blobs for k, v in p)


def encode_state(keys_pre: torch.Tensor | list[torch.Tensor], values: torch.Tensor | list[torch.Tensor],
                 token_sets: list[torch.Tensor] | Callable[[], list[torch.Tensor]],
                 settings: CodecSettings | str | float | None = None, *,
                 device: torch.device | str | None = None, sync_timings: bool = False,
                 overhead_bytes: int | Callable[[list[torch.Tensor]], int] | None = None,
                 regenerator=None, layer_weights=None) -> EncodedState:
    """Fit and encode a whole document: keys (pre-RoPE) and values [L, H, T, d] (or per-layer lists),
    clusters given as token index sets (a partition of range(T), each ascending).

    ``token_sets`` may be a function that returns them: the fit does not need the clusters, so it is
    called once the fit is queued, and the caller's clustering runs on the host while the GPU fits.

    Every part keeps the attention sinks (positions < ``sink_tokens``) in fp16, as
    the per-layer ``encode(..., positions)`` does. ``sync_timings`` synchronizes the device between stages so
    ``timings_ms`` splits the time by stage (off: one figure per stage, host-side only).
    ``overhead_bytes``: the container header's expected bytes, or a function of the clusters that
    gives them (a state-wide budget counts them; default :func:`.state_bits.container_overhead`).
    ``regenerator``: a :class:`kite.upcycle.codec.Regenerator` of the model that :func:`.batched_regen.takes`:
    each layer side is coded on its basis or the document's, as the per-layer codec chooses
    (``info["regenerated_sides"]`` counts those on its basis). ``layer_weights``: each (layer, side)'s
    weight in the state-wide allocation (:class:`.layer_weights.LayerWeights`).
    """
    s = settings_for(settings)
    if not supports(s):
        raise ValueError(f"the batched codec takes pca keys and values without outliers, not {s.name}")
    if regenerator is not None and not takes(regenerator, s):
        raise ValueError("the batched codec takes an unweighted regenerator choosing by the expected error, "
                         "with a state-wide budget")
    if isinstance(keys_pre, (list, tuple)):
        dev0 = keys_pre[0].device
    else:
        dev0 = keys_pre.device
    dev = torch.device(device) if device is not None else dev0
    clock = StageClock(dev, sync_timings)
    K = torch.stack(list(keys_pre)).to(dev, torch.float32) if isinstance(keys_pre, (list, tuple)) \
        else keys_pre.to(dev, torch.float32)
    V = torch.stack(list(values)).to(dev, torch.float32) if isinstance(values, (list, tuple)) \
        else values.to(dev, torch.float32)
    if K.dim() != 4 or K.shape != V.shape:
        raise ValueError(f"keys and values must both be [L, H, T, d], got {tuple(K.shape)} and {tuple(V.shape)}")
    L, H, T, d = K.shape
    if not callable(token_sets):
        sets = partition(token_sets, T)
    clock.lap("move")
    solved = solve_launch({"k": (K, s.k_bits), "v": (V, s.v_bits)}, s, clock)
    if callable(token_sets):
        sets = partition(token_sets(), T)
        clock.lap("cluster (caller's)")
    fits = fit_launch(solved, s, clock, sets, overhead_bytes(sets) if callable(overhead_bytes) else overhead_bytes,
                      regenerator, layer_weights)
    del solved
    lay = layout(sets, s, dev)   # host work while the eigensolver runs
    # the tokens gathered and centered while the eigensolver runs on its stream
    gathered = {prefix: gather_center(X, fits[prefix].mean_st, lay, clock) for prefix, X in (("k", K), ("v", V))}
    join_side_stream(dev)
    plans = {prefix: runs_plan(f.row_bits, lay.ng, lay.gs, s.max_bits) for prefix, f in fits.items()}
    small = []
    for prefix, f in fits.items():
        small += [f.bits, f.solved, f.row_bits, plans[prefix].tables]
        if "plan" in f.stored:
            small.append(f.stored["plan"].tables)
        if f.regen is not None:
            small.append(f.regen)
    *small_h, tables_ready = host_async(*small)
    clock.lap("encode: plan")
    # the side with more bits first: its codes go to the host while the other side is encoded
    order = [("v", V), ("k", K)] if s.v_bits >= s.k_bits else [("k", K), ("v", V)]
    coded, done, out_x = {}, {}, {}
    for prefix, X in order:
        coded[prefix] = encode_side(prefix, X, gathered.pop(prefix), fits[prefix], plans[prefix], lay, s, clock, out_x)
        done[prefix] = record_event(dev)
    # the one wait for the device before the end: the bit allocations and the plans' sizes (the
    # encode queued above keeps the device busy meanwhile), then copies of exactly what was written
    if tables_ready is not None:
        tables_ready.synchronize()
    small_h = iter(t.numpy() for t in small_h)
    host: dict[str, HostSide] = {}
    for prefix, f in fits.items():
        bits_h, solved_h, row_bits_h, tables_h = (next(small_h) for _ in range(4))
        if not solved_h.all():
            bad = sorted({int(i) for i in np.nonzero(~solved_h)[0]})
            raise KiteError(f"the eigensolver did not converge on the {prefix} Gram of layer(s) {bad} "
                            "(non-finite KV values?)")
        host[prefix] = HostSide(f.B, f.D, bits_h, row_bits_h, tables_h,
                                 next(small_h) if "plan" in f.stored else None,
                                 regen=next(small_h) if f.regen is not None else None)
    for prefix, _ in order:   # the copy stream runs in order: first done, first copied
        copy_back(fits[prefix], coded[prefix], host[prefix], done[prefix])
    xs = list(out_x.items())
    out_x_h = {k: (h, v.shape) for (k, v), h in zip(xs, to_host([v.contiguous().view(torch.uint8) for _, v in xs]))}
    host_sync(dev)
    clock.lap("encode: wait for the host copies")

    layer_blobs = [layer_blob(layer, host, s, H, d, T) for layer in range(L)]
    clock.lap("fit: layer blobs")
    part_blobs = [[tuple(part_blob(layer, c, int(t_set.numel()), prefix, host[prefix], out_x_h, lay.forced[c])
                         for prefix in ("k", "v"))
                   for c, t_set in enumerate(sets)] for layer in range(L)]
    clock.lap("serialize")
    info = {f"R_{prefix}": [hs.rank(layer) for layer in range(L)] for prefix, hs in host.items()}
    info["regenerated_sides"] = sum(int(hs.regen.sum()) for hs in host.values() if hs.regen is not None)
    return EncodedState(layer_blobs=layer_blobs, part_blobs=part_blobs,
                        timings_ms={k: round(v, 3) for k, v in clock.times.items()}, info=info)
