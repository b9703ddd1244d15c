"""A loaded state held in nibble lanes (kite.kernels.lanes) for the batch's attention to read
(``kite serve --resident lanes``): the load's KV (``load_prefix``: any clusters, layers and
precision) coded per layer into lanes on the model's device (kite.upcycle.codec.lanes), keys as the
cache holds them (post-RoPE). The lanes are a second quantization on top of the state's own codec: their cost in
quality is measured by ``benchmarks/lanes_quality.py``; what they buy is decode attention read from
4-bit (or 2-bit) codes near its byte floor (``benchmarks/lanes_decode.py``)."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from kite.errors import BadInput


def lanes_for(bits: int, head_dim: int) -> int:
    """Lanes a row for ``bits`` an element of ``head_dim`` (a power of 2, 2..2 x head_dim)."""
    lanes = bits * head_dim // 4
    if lanes < 2 or lanes & (lanes - 1) or lanes > 2 * head_dim:
        raise BadInput(f"{bits} bits an element of {head_dim} dims is {lanes} lanes a row: not a power of 2 "
                       f"in 2..{2 * head_dim}")
    return lanes


def load_lanes(state, lm, *, lane_bits: tuple[int, int] = (4, 4), group: int = 512, sinks: int = 1, **kwargs):
    """``load_prefix(state, lm, **kwargs)`` held in lanes: (a LanesPrefix: a kite.kernels.lanes.Lanes
    per layer, None where a layer holds nothing; its LoadReport with ``resident`` "lanes" and
    ``resident_bytes`` the lanes' bytes). ``lane_bits``: bits an element for keys and values."""
    from kite.upcycle.load.prefix import load_prefix

    prefix, report = load_prefix(state, lm, **kwargs)
    t0 = time.perf_counter()
    held = lanes_of(prefix, lm.geometry.head_dim, torch.device(lm.device), lane_bits=lane_bits, group=group,
                    sinks=sinks)
    timings = dict(report.timings_ms, lanes=round((time.perf_counter() - t0) * 1e3, 3))
    return held, replace(report, timings_ms=timings, resident="lanes", resident_bytes=held.nbytes())


def lanes_of(prefix, head_dim: int, device, *, lane_bits: tuple[int, int] = (4, 4), group: int = 512,
             sinks: int = 1):
    """A KVPrefix coded into nibble lanes on ``device`` (``lane_bits``: bits an element for keys and
    values; groups of ``group`` rows, the first ``sinks`` tokens exact): a LanesPrefix, None for each
    layer that holds nothing; the bases bf16 on a GPU, fp32 elsewhere."""
    from kite.runtime.resident import LanesPrefix
    from kite.upcycle.codec.lanes import encode_layers

    dev = torch.device(device)
    k_lanes, v_lanes = lanes_for(lane_bits[0], head_dim), lanes_for(lane_bits[1], head_dim)
    basis = torch.bfloat16 if dev.type == "cuda" else torch.float32
    held_at = [i for i, k in enumerate(prefix.keys) if k.shape[-2] > 0]
    coded = encode_layers([prefix.keys[i].to(dev, torch.float32) for i in held_at],
                          [prefix.values[i].to(dev, torch.float32) for i in held_at], k_lanes, v_lanes,
                          group=group, sinks=sinks) if held_at else []
    layers = [None] * len(prefix.keys)
    for i, x in zip(held_at, coded):
        layers[i] = x.to(basis_dtype=basis)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return LanesPrefix(layers=layers, next_position=prefix.next_position, reader=prefix.reader)
