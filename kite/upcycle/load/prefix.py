"""`.upc` → KV prefix: check fingerprints, read only the parts asked for, rebuild, re-apply RoPE.

With the model on a GPU and a PCA-coded state, the compressed parts go to the GPU through the hot
tier and are rebuilt there (:mod:`.staging`, :mod:`.rebuild`); otherwise the codec decodes them on
the host.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kite.errors import BadInput, FingerprintMismatch
from kite.model.fingerprint import PREFIX, short
from kite.shortid import apart
from kite.runtime.cache import KVPrefix
from kite.upcycle import codec
from kite.upcycle.codec.regenerator import resolve
from kite.upcycle.format.container import StateFile
from kite.upcycle.codec.groups import group_geometry, split_group
from kite.upcycle.format.names import blob_key, group_of, groups_of
from kite.upcycle.load.fidelity import load_warnings
from kite.upcycle.load.hot_tier import HotTier, default_tier
from kite.upcycle.load.parts import decode_part, read_layer, read_part
from kite.upcycle.load.rebuild import load_staged
from kite.upcycle.load.selection import SINK_TOKENS, Selection, select
from kite.upcycle.load.staging import stage_state, supports_state
from kite.upcycle.load.tail import Tail, recompute_tail, recompute_tails, tail_ids
from kite.upcycle.rope import apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from kite.model import LoadedModel

LOAD_PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")


@dataclass
class LoadReport:
    clusters: list[int]
    labels: list[str]
    layers: list[int]
    precision: str | None
    tokens: int  # document tokens loaded (per loaded layer), sinks included
    bytes_read: int
    load_ms: float
    timings_ms: dict[str, float] = field(default_factory=dict)
    sink_tokens: int = 0  # of `tokens`, how many came along as attention sinks
    warnings: list[str] = field(default_factory=list)  # the load is far from what the state was made for
    resident: str = "raw"  # the resident form the prefix is held in (kite.upcycle.RESIDENT_FORMS): "raw", "lanes"
    resident_bytes: int | None = None  # bytes the loaded prefix holds on its device
    recomputed_tokens: int = 0  # of `tokens`, the state's last ones run through the model (its recomputed tail)

    def to_dict(self) -> dict:
        return asdict(self)


def check_fingerprints(state: StateFile, lm: LoadedModel) -> None:
    """Invariant 3: a state made by another model, tokenizer or adapter never loads silently.

    The adapter is a reader (on only while a state made for it is read; the state's KV is the base
    model's): a state made for one loads only on a model that has it; a state made for none loads
    on any model of its weights and tokenizer, and the reader stays off for it."""
    have = state.meta.get("fingerprints") or {}
    want = lm.fingerprints
    if have.get("model") is None and have.get("migrated_from"):
        # Migrated knowing only the new model's combined fingerprint (full or short form).
        if want.combined.removeprefix(PREFIX).startswith(have["combined"].removeprefix(PREFIX)):
            return
        to, loaded = apart(have["combined"], want.combined)
        raise FingerprintMismatch(
            f"{state.path}: migrated to model {to}, but the loaded model is "
            f"{loaded}; load that model or migrate the state again")
    made_for = have.get("adapter")
    if made_for is not None and made_for != want.adapter:
        theirs, ours = apart(made_for, want.adapter)
        raise FingerprintMismatch(
            f"{state.path}: made for reader adapter {theirs}, and the loaded model has "
            f"{'reader adapter ' + ours if want.adapter else 'none'}; load the model with that "
            f"adapter (upcycle_config adapter.path, kite generate --adapter DIR), or compress the document again")
    for part in ("model", "tokenizer"):
        a, b = have.get(part), getattr(want, part)
        if a != b:
            old = short(have.get("combined") or "") or "?"
            made, loaded = apart(a, b)
            raise FingerprintMismatch(
                f"{state.path}: made with another {part} ({part} fingerprint {made} ≠ "
                f"{loaded} of the loaded model); re-run `kite upcycle compress`, or if the "
                f"weights are compatible: kite upcycle migrate --old-model-fingerprint {old} "
                f"--new-model-fingerprint {short(want.combined)} --upcycle-dir {state.path.parent}")


def check_geometry(state: StateFile, lm: LoadedModel) -> None:
    """A state's KV geometry (layers, KV heads, head size) is the model's, checked before any part
    is read: one BadInput line for the first that differs."""
    have = state.meta["model"]["geometry"]
    want = lm.geometry
    for key, what in (("n_layers", "layers"), ("n_kv_heads", "KV heads"), ("head_dim", "head_dim")):
        if have[key] != getattr(want, key):
            raise BadInput(f"{state.path}: the state was made for a model with {have[key]} {what}; the loaded "
                           f"model has {getattr(want, key)}")


def _on_gpu(state: StateFile, lm: LoadedModel, precision: str | None) -> bool:
    if torch.device(lm.device).type != "cuda" or not supports_state(state):
        return False
    return precision in (None, "fp32") or {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision) == lm.dtype


def _load_on_gpu(state: StateFile, lm: LoadedModel, sel: Selection, layer_set: set[int], verify: bool, sink_tokens: int,
                 tier: HotTier | None, regenerator) -> tuple[list, list, int, dict]:
    geo = lm.geometry
    H, d = geo.n_kv_heads, geo.head_dim
    tier = tier or default_tier()
    key = (state.version, tuple(sel.chosen), sink_tokens, tuple(sorted(layer_set)))
    t = time.perf_counter()
    hot = tier.get(key)
    hit = hot is not None
    if not hit:
        hot = stage_state(state, sel.parts, sel.part_positions, sorted(layer_set), n_layers=geo.n_layers,
                          H=H, d=d, verify=verify, tier=tier, key=key, wait=False, regenerator=regenerator)
    cos, sin = rope_cos_sin(lm.model, hot.positions, device=lm.device)
    keys, values = load_staged(hot, device=lm.device, dtype=lm.dtype, cos=cos, sin=sin, n_layers=geo.n_layers)
    if not hit:
        tier.put(hot)
    empty = torch.zeros(H, 0, d, dtype=lm.dtype, device=lm.device)
    keys = [k if k is not None else empty for k in keys]
    values = [v if v is not None else empty for v in values]
    torch.cuda.synchronize(lm.device)
    timings = {"gpu_load": round((time.perf_counter() - t) * 1e3, 3), "hot_tier_hit": float(hit)}
    return keys, values, 0 if hit else hot.bytes_read, timings


def _at_precision(x: torch.Tensor, precision: str | None) -> torch.Tensor:
    if precision is None or precision == "fp32":
        return x
    if precision in ("fp16", "bf16"):
        return x.to(getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision])).float()
    group = 32 if precision in ("int4",) else 64
    return codec.dequantize(codec.quantize(x, precision, group_size=group, axis=-1))


class HostRebuild:
    """A state's chosen parts rebuilt on the host one layer at a time: each layer's parts read
    (checksums checked when ``verify``), decoded, put in position order, keys rotated to their
    positions (RoPE from ``lm.model``: a model, its rotary module or its config) and cast to
    ``lm.dtype`` on ``lm.device``. What :func:`load_prefix` runs off the GPU, and what a serving
    engine's connector runs layer by layer into its own cache. Checks are the caller's
    (:func:`check_fingerprints`, :func:`check_geometry`)."""

    def __init__(self, state: StateFile, lm: LoadedModel, sel: Selection, *, verify: bool = True,
                 precision: str | None = None, regenerator=None):
        self.state, self.sel, self.verify, self.precision, self.regenerator = state, sel, verify, precision, regenerator
        geo = lm.geometry
        self.H, self.d, self.device, self.dtype = geo.n_kv_heads, geo.head_dim, lm.device, lm.dtype
        positions, self.order = sel.positions()
        self.positions = positions[self.order]   # the rebuilt rows' document positions, ascending
        self.cos, self.sin = rope_cos_sin(lm.model, self.positions, device="cpu")
        self.bytes_read = 0
        self.t_read = self.t_decode = 0.0
        self.groups = groups_of(state.meta, geo.n_layers)
        self._group: tuple[int, list] | None = None
        self._rope_dev: tuple | None = None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of ``layer``, each [H, T, d]: row i is the token at ``positions[i]``. A
        layer of a state coded on bases across layers decodes its group (kept for the group's
        next layer)."""
        sel, H, d = self.sel, self.H, self.d
        a, b = group_of(self.groups, layer)
        if self._group is None or self._group[0] != a:
            self._group = None     # (the group before is let go first)
            self._group = (a, self._decoded(a, *(group_geometry((a, b), H, d) if b - a > 1 else (H, d)),
                                            grouped=b - a > 1))
        t = time.perf_counter()
        decoded = self._group[1]
        if b - a > 1:
            decoded = [(split_group(k, H, d, layer - a), split_group(v, H, d, layer - a)) for k, v in decoded]
        ks = [k if keep is None else k[:, keep] for (k, _), (_, keep) in zip(decoded, sel.parts)]
        vs = [v if keep is None else v[:, keep] for (_, v), (_, keep) in zip(decoded, sel.parts)]
        order, cos, sin = self._rope_on(ks[0].device)
        k = apply_rope(torch.cat(ks, dim=1)[:, order], cos, sin)
        v = torch.cat(vs, dim=1)[:, order]
        out = (_at_precision(k, self.precision).to(self.device, self.dtype),
               _at_precision(v, self.precision).to(self.device, self.dtype))
        self.t_decode += time.perf_counter() - t
        return out

    def _rope_on(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' order and RoPE tables on ``device`` (copied there once)."""
        if torch.device(device).type == "cpu":
            return self.order, self.cos, self.sin
        if self._rope_dev is None:
            self._rope_dev = tuple(t.to(device) for t in (self.order, self.cos, self.sin))
        return self._rope_dev

    def _decoded(self, lead: int, H: int, d: int, grouped: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The chosen parts of the layer (or the header's group: ``grouped``) whose blobs are under
        ``lead``, read and decoded: per part (keys, values) [H, T_part, d] in the codec's geometry."""
        state, sel = self.state, self.sel
        t = time.perf_counter()
        lc, widths = read_layer(state, lead, self.verify, H, d)
        # a group's product with its basis (every layer's features) runs on the model's GPU, and its
        # layers stay there (RoPE applied there too)
        where = self.device if grouped and torch.device(self.device).type == "cuda" else "cpu"
        if self.regenerator is not None:
            codec.attach_regenerator(lc, {side: self.regenerator.basis_on(lead, side, where) for side in ("k", "v")},
                                     device=where)
        self.bytes_read += state.index[blob_key(None, lead)].length
        parts = []
        for (c, _), pos in zip(sel.parts, sel.part_positions):
            kb, vb = (read_part(state, blob_key(c, lead, side), self.verify, lc, widths, int(pos.numel()), H, d)
                      for side in ("K", "V"))
            self.bytes_read += state.index[blob_key(c, lead, "K")].length + state.index[blob_key(c, lead, "V")].length
            parts.append(codec.EncodedPart(kb, vb))
        self.t_read += time.perf_counter() - t
        t = time.perf_counter()
        decoded = [decode_part(state, lc, p, c, lead) for p, (c, _) in zip(parts, sel.parts)]
        self.t_decode += time.perf_counter() - t
        return decoded


def _load_on_host(state: StateFile, lm: LoadedModel, sel: Selection, layer_set: set[int], verify: bool,
                  precision: str | None, regenerator) -> tuple[list, list, int, dict]:
    geo = lm.geometry
    empty = torch.zeros(geo.n_kv_heads, 0, geo.head_dim, dtype=lm.dtype, device=lm.device)
    rebuild = HostRebuild(state, lm, sel, verify=verify, precision=precision, regenerator=regenerator)
    keys, values = [], []
    for layer in range(geo.n_layers):
        if layer not in layer_set or not sel.chosen:
            keys.append(empty)
            values.append(empty)
            continue
        k, v = rebuild.layer(layer)
        keys.append(k)
        values.append(v)
    return keys, values, rebuild.bytes_read, {"read": round(rebuild.t_read * 1e3, 3),
                                               "decode": round(rebuild.t_decode * 1e3, 3)}


def _checked(state: StateFile | str | Path, lm: LoadedModel, precision: str | None, regenerator):
    """``state`` opened and checked for ``lm`` before any part is read (the precision asked, the
    fingerprints, the geometry), and the regenerator it was coded on (None: coded on its own bases)."""
    if not isinstance(state, StateFile):
        state = StateFile(state)
    if precision is not None and precision not in LOAD_PRECISIONS:
        raise BadInput(f"--precision {precision}: expected one of {', '.join(LOAD_PRECISIONS)}")
    check_fingerprints(state, lm)
    check_geometry(state, lm)
    regen_fp = (state.meta.get("regenerator") or {}).get("fingerprint")
    return state, (resolve(regen_fp, regenerator) if regen_fp else None)


def open_rebuild(state: StateFile | str | Path, lm: LoadedModel, *, clusters: list[str] | None = None,
                 precision: str | None = None, verify: bool = True, regenerator=None) -> HostRebuild:
    """A :class:`HostRebuild` of ``state`` for ``lm``, checked as :func:`load_prefix` checks a load
    (fingerprints, geometry, the regenerator the state was coded on) before any part is read.
    ``lm`` needs only ``fingerprints``, ``geometry``, ``model`` (for RoPE: the model, its rotary
    module or its config), ``device`` and ``dtype``: no weights. No attention sinks come along
    (``clusters``: labels or ids, None = all)."""
    state, regenerator = _checked(state, lm, precision, regenerator)
    return HostRebuild(state, lm, select(state, clusters, 0), verify=verify, precision=precision,
                       regenerator=regenerator)


@torch.inference_mode()
def load_prefix(state: StateFile | str | Path, lm: LoadedModel, *, clusters: list[str] | None = None,
                layers: list[int] | None = None, precision: str | None = None,
                verify: bool = True, sink_tokens: int = SINK_TOKENS,
                tier: HotTier | None = None, regenerator=None) -> tuple[KVPrefix, LoadReport]:
    """Rebuild the KV prefix of the chosen clusters and layers of `state` for `lm`.

    Loaded tokens keep their original positions; the query goes after the document's last one.
    Layers not chosen get an empty prefix. `precision` sets the precision the prefix is held at.
    The report's `warnings` say when the load is far from what the state was made for (too few
    layers, a precision below the state's own: :mod:`.fidelity`).
    When only some clusters are chosen, the document's first `sink_tokens` tokens come too.
    With the model on a GPU and a PCA-coded state, the compressed parts go to the GPU and are
    rebuilt there, through the pinned hot tier `tier` (default: the process's); otherwise they are
    decoded on the host. A state coded on a regenerator's bases decodes with that regenerator only:
    `regenerator` when it is the one, else the copy kept under ``$KITE_HOME/regenerators``
    (FingerprintMismatch naming it when there is none). A state that keeps its last tokens as ids
    (:mod:`.tail`) has them run through the model after the rebuilt prefix.
    """
    coded = _load_coded(state, lm, clusters, layers, precision, verify, sink_tokens, tier, regenerator)
    if coded.tail.ids:
        t = time.perf_counter()
        recompute_tail(lm, coded.tail.keys, coded.tail.values, coded.tail.ids, coded.tail.n_tokens,
                       coded.tail.layers, coded.reader)
        coded.timings["recompute"] = round((time.perf_counter() - t) * 1e3, 3)
    return coded.finish(lm)


@torch.inference_mode()
def load_prefixes(states: list[StateFile | str | Path], lm: LoadedModel, *, verify: bool = True,
                  tier: HotTier | None = None, regenerator=None) -> list[tuple[KVPrefix, LoadReport]]:
    """:func:`load_prefix` of each of ``states`` whole, their recomputed tails run through the model
    together where its device batches forwards (:func:`kite.upcycle.load.tail.recompute_tails`: on
    a GPU a tail's forward is bound by the host's launches, so several cost about what one does).
    Each report's ``timings_ms.recompute`` is its share of its tails' forwards."""
    coded = [_load_coded(s, lm, None, None, None, verify, SINK_TOKENS, tier, regenerator) for s in states]
    for reader in (False, True):
        these = [c for c in coded if c.tail.ids and c.reader == reader]
        if these:
            t = time.perf_counter()
            recompute_tails(lm, [c.tail for c in these], reader)
            share = round((time.perf_counter() - t) * 1e3 / len(these), 3)
            for c in these:
                c.timings["recompute"] = share
    return [c.finish(lm) for c in coded]


@dataclass
class _Coded:
    """A state's prefix rebuilt from its coded parts, its tail (if any) not yet run."""

    state: StateFile
    sel: Selection
    layers: list[int]
    precision: str | None
    tail: Tail          # its keys and values are the prefix's, appended to in place
    reader: bool
    bytes_read: int
    timings: dict
    elapsed_s: float    # the load's seconds so far

    def finish(self, lm: LoadedModel) -> tuple[KVPrefix, LoadReport]:
        prefix = KVPrefix(self.tail.keys, self.tail.values, next_position=self.tail.n_tokens, reader=self.reader)
        # its own seconds: the coded parts' and its tail's (or its share of a shared forward), not
        # the other states' of a load of several
        spent = self.elapsed_s + self.timings.get("recompute", 0.0) / 1e3
        return prefix, load_report(self.state, lm.geometry.n_layers, self.sel, self.layers, self.precision,
                                   bytes_read=self.bytes_read, t0=time.perf_counter() - spent, timings=self.timings,
                                   resident_bytes=prefix.nbytes(), recomputed=len(self.tail.ids))


def _load_coded(state, lm: LoadedModel, clusters, layers, precision, verify: bool, sink_tokens: int,
                tier: HotTier | None, regenerator) -> _Coded:
    t0 = time.perf_counter()
    state, regenerator = _checked(state, lm, precision, regenerator)
    n_layers = lm.geometry.n_layers
    sel = select(state, clusters, sink_tokens)
    if layers is not None and not layers:
        raise BadInput("--layers: no layers given (a load into no layer loads nothing)")
    layer_set = set(range(n_layers)) if layers is None else set(layers)
    bad = sorted(layer for layer in layer_set if not 0 <= layer < n_layers)
    if bad:
        raise BadInput(f"--layers: layer {bad[0]} is out of range 0-{n_layers - 1} (the model has {n_layers} "
                       f"layers)")
    if _on_gpu(state, lm, precision) and sel.chosen:
        keys, values, nbytes, timings = _load_on_gpu(state, lm, sel, layer_set, verify, sink_tokens, tier,
                                                     regenerator)
    else:
        keys, values, nbytes, timings = _load_on_host(state, lm, sel, layer_set, verify, precision, regenerator)
    made_for = (state.meta.get("fingerprints") or {}).get("adapter")
    reader = made_for is not None and made_for == lm.fingerprints.adapter
    tail = tail_ids(state.meta) if sel.chosen else []     # (nothing loaded: nothing for the tail to read)
    return _Coded(state, sel, sorted(layer_set), precision, Tail(keys, values, tail, int(state.meta["n_tokens"]), layer_set),
                  reader, nbytes, timings, time.perf_counter() - t0)


def load_report(state: StateFile, n_layers: int, sel: Selection, layers: list[int], precision: str | None, *,
                bytes_read: int, t0: float, timings: dict, resident: str = "raw",
                resident_bytes: int | None = None, recomputed: int = 0) -> LoadReport:
    """The report of a load of ``sel`` into ``layers`` begun at ``t0`` (time.perf_counter()), in
    either form (``resident``); ``recomputed``: the state's tail tokens the load ran through the model."""
    return LoadReport(clusters=sel.chosen, labels=sel.labels, layers=layers, precision=precision,
                      tokens=recomputed + int(sum(int(p.numel()) if keep is None else int(keep.sum())
                                                  for (_, keep), p in zip(sel.parts, sel.part_positions))),
                      recomputed_tokens=recomputed,
                      sink_tokens=sel.sink_tokens, bytes_read=bytes_read,
                      load_ms=round((time.perf_counter() - t0) * 1e3, 3), timings_ms=timings,
                      warnings=load_warnings(state.meta, n_layers, layers, precision), resident=resident,
                      resident_bytes=resident_bytes)
