"""`.upc` → KV prefix: check fingerprints, read only the parts asked for, rebuild, re-apply RoPE."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kite.errors import BadInput, FingerprintMismatch
from kite.model.fingerprint import PREFIX, short
from kite.runtime.cache import KVPrefix
from kite.upcycle import codec
from kite.upcycle.compress import blob_key
from kite.upcycle.quant import dequantize, quantize
from kite.upcycle.rope import apply_rope, rope_cos_sin
from kite.upcycle.state_file import StateFile

LOAD_PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
# A partial load always brings the document's first tokens along: they are attention sinks
# (most of the attention mass lands on them), and without them a cluster loaded alone made the
# model worse than no state at all in the bench (kite bench run, embedded model).
SINK_TOKENS = 4


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

    def to_dict(self) -> dict:
        return asdict(self)


def check_fingerprints(state: StateFile, lm) -> None:
    """Invariant 3: a state made by another model, tokenizer or adapter never loads silently."""
    have = state.meta.get("fingerprints") or {}
    want = lm.fingerprints
    if have.get("model") is None and have.get("migrated_from"):
        # Migrated knowing only the new model's combined fingerprint (full or short form).
        if want.combined.removeprefix(PREFIX).startswith(have["combined"].removeprefix(PREFIX)):
            return
        raise FingerprintMismatch(
            f"{state.path}: migrated to model {short(have['combined'])}, but the loaded model is "
            f"{short(want.combined)}; load that model or migrate the state again")
    for part in ("model", "tokenizer", "adapter"):
        a, b = have.get(part), getattr(want, part)
        if a != b:
            old = short(have.get("combined") or "") or "?"
            raise FingerprintMismatch(
                f"{state.path}: made with another {part} ({part} fingerprint {short(a or 'none')} ≠ "
                f"{short(b or 'none')} of the loaded model); re-run `kite upcycle compress`, or if the "
                f"weights are compatible: kite upcycle migrate --old-model-fingerprint {old} "
                f"--new-model-fingerprint {short(want.combined)} --upcycle-dir {state.path.parent}")


def select_clusters(state: StateFile, wanted: list[str] | None) -> list[int]:
    """Cluster ids for labels or ids in `wanted` (None = all). Unknown names are BadInput."""
    clusters = state.meta["clusters"]
    if not wanted:
        return [c["id"] for c in clusters]
    chosen: list[int] = []
    labels = sorted({c["label"] for c in clusters})
    for name in wanted:
        hits = [c["id"] for c in clusters if c["label"] == name or str(c["id"]) == name]
        if not hits:
            raise BadInput(f"--clusters {name}: not in this state (labels: {', '.join(labels)}; "
                           f"or cluster ids 0-{len(clusters) - 1})")
        chosen.extend(h for h in hits if h not in chosen)
    return sorted(chosen)


def _gpu_path(state: StateFile, device, dtype, precision: str | None) -> bool:
    from kite.upcycle.gpu_load import supports_state

    if torch.device(device).type != "cuda" or not supports_state(state):
        return False
    return precision in (None, "fp32") or {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision) == dtype


def _load_on_gpu(state, lm, chosen, selection, cluster_positions, layer_set, verify, sink_tokens, precision, tier,
                 t0) -> tuple[KVPrefix, LoadReport]:
    from kite.upcycle import gpu_load

    geo = lm.geometry
    H, d = geo.n_kv_heads, geo.head_dim
    tier = tier or gpu_load.default_tier()
    st = state.path.stat()
    key = (str(state.path.resolve()), st.st_mtime_ns, st.st_size, tuple(chosen), sink_tokens, tuple(sorted(layer_set)))
    t = time.perf_counter()
    hot = tier.get(key)
    hit = hot is not None
    if not hit:
        hot = gpu_load.stage_state(state, selection, [cluster_positions(c) for c, _ in selection], sorted(layer_set),
                                   n_layers=geo.n_layers, H=H, d=d, verify=verify, tier=tier, key=key, wait=False)
    cos, sin = rope_cos_sin(lm.model, hot.positions, device=lm.device)
    keys, values = gpu_load.load_staged(hot, device=lm.device, dtype=lm.dtype, cos=cos, sin=sin, n_layers=geo.n_layers)
    if not hit:
        tier.put(hot)
    empty = torch.zeros(H, 0, d, dtype=lm.dtype, device=lm.device)
    keys = [k if k is not None else empty for k in keys]
    values = [v if v is not None else empty for v in values]
    torch.cuda.synchronize(lm.device)
    info = {c["id"]: c for c in state.meta["clusters"]}
    prefix = KVPrefix(keys, values, next_position=int(state.meta["n_tokens"]))
    report = LoadReport(clusters=chosen, labels=[info[c]["label"] for c in chosen], layers=sorted(layer_set),
                        precision=precision, tokens=int(hot.positions.numel()),
                        sink_tokens=sum(int(keep.sum()) for _, keep in selection if keep is not None),
                        bytes_read=0 if hit else hot.bytes_read, load_ms=round((time.perf_counter() - t0) * 1e3, 3),
                        timings_ms={"gpu_load": round((time.perf_counter() - t) * 1e3, 3),
                                    "hot_tier_hit": float(hit)})
    return prefix, report


def _at_precision(x: torch.Tensor, precision: str | None) -> torch.Tensor:
    if precision is None or precision == "fp32":
        return x
    if precision in ("fp16", "bf16"):
        return x.to(getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision])).float()
    group = 32 if precision in ("int4",) else 64
    return dequantize(quantize(x, precision, group_size=group, axis=-1))


@torch.inference_mode()
def load_prefix(state: StateFile | str | Path, lm, *, clusters: list[str] | None = None,
                layers: list[int] | None = None, precision: str | None = None,
                verify: bool = True, sink_tokens: int = SINK_TOKENS, tier=None) -> tuple[KVPrefix, LoadReport]:
    """Rebuild the KV prefix of the chosen clusters and layers of `state` for `lm`.

    Loaded tokens keep their original positions; the query goes after the document's last one.
    Layers not chosen get an empty prefix. `precision` sets the precision the prefix is held at.
    When only some clusters are chosen, the document's first `sink_tokens` tokens come too.
    With the model on a GPU and a PCA-coded state, the compressed parts go to the GPU and are
    rebuilt there (`kite.upcycle.gpu_load`, through the pinned hot tier `tier`, default
    `gpu_load.default_tier()`); otherwise they are decoded on the host.
    """
    t0 = time.perf_counter()
    if not isinstance(state, StateFile):
        state = StateFile(state)
    if precision is not None and precision not in LOAD_PRECISIONS:
        raise BadInput(f"--precision {precision}: expected one of {', '.join(LOAD_PRECISIONS)}")
    check_fingerprints(state, lm)
    geo = lm.geometry
    chosen = select_clusters(state, clusters)
    layer_set = set(range(geo.n_layers)) if layers is None else set(layers)
    bad = sorted(l for l in layer_set if not 0 <= l < geo.n_layers)
    if bad:
        raise BadInput(f"--layers: layer {bad[0]} is out of range 0-{geo.n_layers - 1}")
    info = {c["id"]: c for c in state.meta["clusters"]}

    def cluster_positions(c: int) -> torch.Tensor:
        return torch.cat([torch.arange(s, e) for s, e in info[c]["token_ranges"]])

    # (cluster, which of its tokens to keep: None = all) — chosen clusters, then the sinks.
    selection: list[tuple[int, torch.Tensor | None]] = [(c, None) for c in chosen]
    if chosen and sink_tokens > 0:
        for c in sorted(set(info) - set(chosen)):
            keep = cluster_positions(c) < sink_tokens
            if keep.any():
                selection.append((c, keep))
    positions = torch.cat([cluster_positions(c) if keep is None else cluster_positions(c)[keep]
                           for c, keep in selection] or [torch.zeros(0, dtype=torch.long)])
    order = torch.argsort(positions)
    positions = positions[order]
    device, dtype = lm.device, lm.dtype
    if _gpu_path(state, device, dtype, precision) and chosen:
        return _load_on_gpu(state, lm, chosen, selection, cluster_positions, layer_set, verify, sink_tokens,
                            precision, tier, t0)
    cos, sin = rope_cos_sin(lm.model, positions, device="cpu")
    H, d = geo.n_kv_heads, geo.head_dim
    empty = torch.zeros(H, 0, d, dtype=dtype, device=device)
    keys, values = [], []
    nbytes = 0
    t_read = t_decode = 0.0
    for layer in range(geo.n_layers):
        if layer not in layer_set or not chosen:
            keys.append(empty)
            values.append(empty)
            continue
        t = time.perf_counter()
        raw = state.read(blob_key(None, layer), verify=verify)
        lc = codec.from_bytes(raw, codec.LayerCodec)
        parts = []
        for c, _ in selection:
            kb, vb = state.read(blob_key(c, layer, "K"), verify), state.read(blob_key(c, layer, "V"), verify)
            nbytes += state.index[blob_key(c, layer, "K")].length + state.index[blob_key(c, layer, "V")].length
            parts.append(codec.EncodedPart(codec.from_bytes(kb), codec.from_bytes(vb)))
        nbytes += state.index[blob_key(None, layer)].length
        t_read += time.perf_counter() - t
        t = time.perf_counter()
        decoded = [codec.decode(lc, p) for p in parts]
        ks = [k if keep is None else k[:, keep] for (k, _), (_, keep) in zip(decoded, selection)]
        vs = [v if keep is None else v[:, keep] for (_, v), (_, keep) in zip(decoded, selection)]
        k_pre = torch.cat(ks, dim=1)[:, order]
        v = torch.cat(vs, dim=1)[:, order]
        k = apply_rope(k_pre, cos, sin)
        keys.append(_at_precision(k, precision).to(device, dtype))
        values.append(_at_precision(v, precision).to(device, dtype))
        t_decode += time.perf_counter() - t
    prefix = KVPrefix(keys, values, next_position=int(state.meta["n_tokens"]))
    report = LoadReport(clusters=chosen, labels=[info[c]["label"] for c in chosen],
                        layers=sorted(layer_set), precision=precision, tokens=int(positions.numel()),
                        sink_tokens=sum(int(keep.sum()) for _, keep in selection if keep is not None),
                        bytes_read=nbytes, load_ms=round((time.perf_counter() - t0) * 1e3, 3),
                        timings_ms={"read": round(t_read * 1e3, 3), "decode": round(t_decode * 1e3, 3)})
    return prefix, report
