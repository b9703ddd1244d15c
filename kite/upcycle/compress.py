"""Document → `.upc`: prefill, capture, cut spans, cluster, tag, compress per cluster × layer, write.

This is the Upcycle pipeline a reader can follow top to bottom in `compress_document`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kite import __version__
from kite.errors import BadInput
from kite.upcycle import codec
from kite.upcycle.address import address_for
from kite.upcycle.capture import Capture, capture, iter_captures
from kite.upcycle.codec import entropy, groups
from kite.upcycle.codec.part_widths import part_widths
from kite.upcycle.codec.probe import ROWS as PROBE_ROWS
from kite.upcycle.codec.probe import AttentionProbe
from kite.upcycle.codec.settings import at_ratio, ratio_of
from kite.upcycle.cluster import kmeans
from kite.upcycle.spans import cut_spans
from kite.upcycle.tail import recomputed_tail
from kite.upcycle.format.container import LARGE_MIN_SAVING, MIN_SAVING, StateWriter, header_estimate
from kite.upcycle.format.names import blob_key
from kite.upcycle.tagging.build import describe_tagger

if TYPE_CHECKING:
    from kite.model import LoadedModel

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass
class CompressSettings:
    codec: codec.CodecSettings = field(default_factory=lambda: codec.settings_for(4.0))
    n_clusters: int = 8
    min_span_tokens: int = 32
    max_span_tokens: int = 128
    chunk_tokens: int = 1024
    seed: int = 0
    # per clause label, its clusters' own ratio (kite.upcycle.label_ratios); others take the codec's
    label_ratios: dict[str, float] = field(default_factory=dict)
    # each (layer, side)'s weight in the state-wide bit allocation, measured for the model
    # (kite.upcycle.codec.LayerWeights, `kite upcycle weigh`); None: keys' k_weight, values 1
    layer_weights: codec.LayerWeights | None = None
    # the codes of every PCA-coded part entropy coded (kite.upcycle.codec.entropy): at a ratio the
    # bits it saves go back into the allocation, so the file stays the size asked
    entropy_coding: bool = False
    # the document's last tokens kept as token ids, not coded: a load runs them through the model
    # after the rebuilt prefix (their KV then exact but for what they read of it); the state's bytes
    # go to the tokens before them. "auto": by the ratio (kite.upcycle.tail)
    recompute_tokens: int | str = "auto"


@dataclass
class ClusterInfo:
    id: int
    label: str
    confidence: float
    token_ranges: list[list[int]]
    n_tokens: int
    preview: str
    probs: dict[str, float] = field(default_factory=dict)


@dataclass
class CompressResult:
    path: str
    n_tokens: int
    clusters: list[ClusterInfo]
    state_bytes: int
    raw_kv_bytes: int  # the document's KV at fp16, what a cache would hold
    timings_ms: dict[str, float]
    spans: dict[str, int] = field(default_factory=dict)   # count, min_tokens, max_tokens
    address: str | None = None   # the content address recorded in the header (None: unaddressed)
    ratio_asked: float | None = None   # the ratio the state was coded to (None: a precision preset, label ratios)
    warnings: list[str] = field(default_factory=list)   # e.g. a ratio this document cannot be coded to
    recomputed_tokens: int = 0   # the document's last tokens kept as ids, recomputed by every load

    @property
    def compression_ratio(self) -> float:
        return self.raw_kv_bytes / self.state_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compression_ratio"] = round(self.compression_ratio, 3)
        return d


def _uses_embeddings(tagger) -> bool:
    return tagger is not None and bool(tagger.embedding_layers)


def _span_embeddings(cap: Capture, spans: list[tuple[int, int]], tagger) -> torch.Tensor:
    """Span vectors for clustering: the tagger's own pooling of the document's hidden states."""
    if _uses_embeddings(tagger):
        return tagger.pool_spans(cap.hidden, spans)
    h = cap.hidden[max(cap.hidden)]
    return torch.stack([h[s:e].mean(0) for s, e in spans])


def _span_tags(lm: LoadedModel, text: str, cap: Capture, spans, emb: torch.Tensor, tagger):
    if _uses_embeddings(tagger):
        return tagger.predict_embeddings(emb)
    # A prompt-scoring tagger reads each span's text.
    texts = [text[cap.offsets[s][0]:cap.offsets[e - 1][1]] for s, e in spans]
    return tagger.tag_texts(lm.model, lm.tokenizer, texts)


def _tag_clusters(assign: torch.Tensor, results) -> list[tuple[str, float, dict]]:
    k = int(assign.max()) + 1
    if results is None:
        return [(f"cluster-{c}", 0.0, {}) for c in range(k)]
    out = []
    for c in range(k):
        members = torch.nonzero(assign == c).flatten().tolist()
        probs: dict[str, float] = {}
        for i in members:
            for label, p in results[i].probs.items():
                probs[label] = probs.get(label, 0.0) + p / len(members)
        label = max(sorted(probs), key=probs.get)
        out.append((label, round(probs[label], 4), {k2: round(v, 4) for k2, v in sorted(probs.items())}))
    return out


def _ranges(token_idx: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for t in token_idx:
        if out and out[-1][1] == t:
            out[-1][1] = t + 1
        else:
            out.append([t, t + 1])
    return out


def _hidden_layers(lm: LoadedModel, tagger) -> list[int]:
    return list(tagger.embedding_layers) if _uses_embeddings(tagger) else [lm.geometry.n_layers // 2]


def capture_for(lm: LoadedModel, text: str, settings: CompressSettings | None = None, *, tagger=None,
                regenerator=None, ids: list[int] | None = None, progress: Callable[[int, int], None] | None = None,
                keep_cache: bool = False, queries: bool = False) -> Capture:
    """The capture :func:`compress_document` makes of ``text`` (its hidden states for the spans'
    clusters, the queries the attention probe reads): made once, it serves several compressions of
    the document (other ratios) and, with ``keep_cache``, forwards that continue the document.
    ``queries``: it also sums its tokens' squared queries (``Capture.query_sq``)."""
    settings = settings or CompressSettings()
    probe_rows = PROBE_ROWS if regenerator is not None and regenerator.choice == "probe" else 0
    return capture(lm, text, chunk_tokens=settings.chunk_tokens, hidden_layers=_hidden_layers(lm, tagger),
                   progress=progress, ids=ids, query_rows=probe_rows, keep_cache=keep_cache, queries=queries)


def captures_for(lm: LoadedModel, texts: Sequence[str], settings: CompressSettings | None = None, *, tagger=None,
                 regenerator=None, keep_cache: bool = False, queries: bool = False) -> Iterator[Capture]:
    """:func:`capture_for` of each text, in order: on a GPU several documents a forward
    (:func:`kite.upcycle.capture.iter_captures`: the same captures to the rounding of the batch's
    products); with the attention probe's regenerator one at a time (its queries are a document's).
    ``queries``: each capture also sums its tokens' squared queries (``Capture.query_sq``)."""
    settings = settings or CompressSettings()
    if regenerator is not None and regenerator.choice == "probe":
        for text in texts:
            yield capture_for(lm, text, settings, tagger=tagger, regenerator=regenerator, keep_cache=keep_cache,
                              queries=queries)
        return
    yield from iter_captures(lm, texts, chunk_tokens=settings.chunk_tokens, hidden_layers=_hidden_layers(lm, tagger),
                             keep_cache=keep_cache, queries=queries)


def compress_document(lm: LoadedModel, text: str, output: str | Path, settings: CompressSettings | None = None, *,
                      tagger=None, source_name: str = "-", progress: Progress | None = None,
                      ids: list[int] | None = None, device: str | torch.device | None = None,
                      regenerator=None, address: bool = False, tenant: str | None = None,
                      captured: Capture | None = None) -> CompressResult:
    """Turn `text` into a `.upc` state at `output` (written atomically).

    `address`: record the state's content address (:mod:`kite.upcycle.address`: the token ids'
    digest, the settings and the id) in its header, so that a store can file and verify it by
    content. The pipeline's states carry it (:meth:`kite.upcycle.Pipeline.compress`); off, the
    header is as before addresses (unaddressed). `tenant`: the tenant the address is made for
    (:mod:`kite.tenants`; None: no tenant, the address as before tenants).

    `regenerator`: a :class:`kite.upcycle.codec.Regenerator` of this model: PCA sides are coded on
    its calibrated bases where that is expected to pay (the state then records its fingerprint and
    loads only with it). The batched codec takes an unweighted one that chooses by the expected error
    (:func:`kite.upcycle.codec.batched_takes_regenerator`, same bytes); others run the per-layer codec.
    `ids`: the document's token ids when the caller already has them (what the state will be
    reused after); `text` is then ignored and rebuilt from the ids' pieces.
    `device`: where the codec runs batched over layers and parts (`kite.upcycle.codec.encode_state`,
    same bytes); None = batched on the model's GPU when it has one, else the per-layer codec.
    Settings the batched codec does not take always use the per-layer codec.
    `captured`: the document's capture when the caller already made it (:func:`capture_for`, with
    the same settings, tagger and regenerator); `text` and `ids` are then ignored.
    """
    settings = settings or CompressSettings()
    _check_settings(lm, settings, regenerator)
    cap = captured if captured is not None else capture_for(
        lm, text, settings, tagger=tagger, regenerator=regenerator, ids=ids,
        progress=(lambda d, t: progress("prefill", d, t)) if progress else None)
    probe_rows = PROBE_ROWS if regenerator is not None and regenerator.choice == "probe" else 0
    if (probe_rows and len(cap.query_tail) != lm.geometry.n_layers) or \
            any(layer not in cap.hidden for layer in _hidden_layers(lm, tagger)):
        raise ValueError("the capture given lacks the hidden states or queries this compression reads "
                         "(make it with capture_for)")
    coded = cap.n_tokens - tail_of(settings, cap.n_tokens)    # (a tail is not coded)
    probe = AttentionProbe(lm, cap.query_tail, cap.n_tokens, coded=coded) if probe_rows else None
    return compress_capture(lm, cap, output, settings, tagger=tagger, source_name=source_name, progress=progress,
                            device=device, regenerator=regenerator, address=address, tenant=tenant, probe=probe)


def _check_settings(lm, settings: CompressSettings, regenerator) -> None:
    if settings.label_ratios and ratio_of(settings.codec) is None:
        raise BadInput(f"per-label ratios need a compression ratio, not the {settings.codec.name} preset")
    if settings.layer_weights is not None:
        settings.layer_weights.check(lm.geometry.n_layers, lm.fingerprints.base)
    if regenerator is not None:
        regenerator.check_model(lm)
        if regenerator.grouped:
            if not codec.state_budgeted(settings.codec) or settings.label_ratios or regenerator.choice == "probe":
                raise BadInput(f"regenerator {regenerator.fingerprint.removeprefix('kite-fp1:')[:12]} has bases across "
                               f"layers: it codes states at one ratio (--ratio R), without per-label ratios or the "
                               f"attention probe")
            if settings.layer_weights is not None:
                raise BadInput("layer weights weigh per-layer bases; a regenerator with bases across layers weighs "
                               "its layers itself (drop --layer-weights)")
        if regenerator.joint_heads != settings.codec.joint_heads:
            raise BadInput(f"regenerator {regenerator.fingerprint.removeprefix('kite-fp1:')[:12]} has "
                           f"{'joint-head' if regenerator.joint_heads else 'per-head'} bases; codec "
                           f"{settings.codec.name} codes {'joint heads' if settings.codec.joint_heads else 'per head'}")


def compress_capture(lm: LoadedModel, cap: Capture, output: str | Path, settings: CompressSettings | None = None, *,
                     tagger=None, source_name: str = "-", progress: Progress | None = None,
                     device: str | torch.device | None = None, regenerator=None, address: bool = False,
                     tenant: str | None = None, probe: AttentionProbe | None = None) -> CompressResult:
    """A captured document → a `.upc` state at `output`: what :func:`compress_document` does after
    its prefill (spans, clusters, tags, codec, write), for a caller that already holds the
    document's KV (a serving engine's connector). ``cap``: the token ids, each layer's pre-RoPE
    keys and values [H, T, d], and the hidden states the spans are clustered on (the tagger's
    ``embedding_layers``, or any one layer without a tagger). ``lm`` needs ``geometry``,
    ``fingerprints``, ``source.spec`` and ``device`` (and ``model``, ``tokenizer`` for a tagger
    that reads span texts, or a regenerator's check). Other arguments as in compress_document;
    ``probe``: the attention probe of a regenerator that chooses by it."""
    settings = settings or CompressSettings()
    _check_settings(lm, settings, regenerator)
    default_ratio = ratio_of(settings.codec)
    timings: dict[str, float] = {"prefill": cap.prefill_ms}
    n_tokens, all_ids = cap.n_tokens, cap.ids
    raw_kv = int(lm.geometry.kv_bytes_per_token("fp16") * n_tokens)   # the whole document's: the ratio's base
    tail = tail_of(settings, n_tokens)
    if tail:        # the tokens before the tail are coded (clustered, tagged) with all of the state's bytes
        cap = capture_head(cap, n_tokens - tail)

    text = cap.text
    clusters: list[ClusterInfo] = []
    n_spans = []
    regenerated = [0]

    def cluster_spans() -> list[torch.Tensor]:
        """Spans, their tags, k-means over them: the clusters' token sets (host work; on a GPU it
        runs while the codec's fit does)."""
        t = time.perf_counter()
        spans = cut_spans(text, cap.offsets, settings.min_span_tokens, settings.max_span_tokens)
        n_spans.append(len(spans))
        emb = _span_embeddings(cap, spans, tagger)
        results = _span_tags(lm, text, cap, spans, emb, tagger) if tagger is not None else None
        # Cluster where the clause types separate: the tagger's calibrated label probabilities
        # (k-means on raw hidden means groups spans by style and position more than by clause type).
        features = (torch.tensor([[r.probs[lab] for lab in sorted(r.probs)] for r in results])
                    if results else emb)
        assign, _ = kmeans(features, settings.n_clusters, seed=settings.seed)
        tags = _tag_clusters(assign, results)
        token_sets: list[torch.Tensor] = []
        assigned = assign.tolist()      # once: on a GPU each read waits for the device
        for c, (label, conf, probs) in enumerate(tags):
            idx = [i for (s, e), a in zip(spans, assigned) if a == c for i in range(s, e)]
            first = next(((s, e) for (s, e), a in zip(spans, assigned) if a == c), (0, 0))
            chars = (cap.offsets[first[0]][0], cap.offsets[first[1] - 1][1]) if cap.offsets else (0, 0)
            preview = " ".join(text[chars[0]:chars[1]].split())[:120]
            clusters.append(ClusterInfo(c, label, conf, _ranges(idx), len(idx), preview, probs))
            token_sets.append(torch.tensor(idx, dtype=torch.long))
        timings["cluster_and_tag"] = (time.perf_counter() - t) * 1e3
        return token_sets

    fps = lm.fingerprints

    def state_meta() -> dict:
        """The header's metadata (the clusters as cut so far; the blob index is the writer's)."""
        spans = {"count": n_spans[0], "min_tokens": settings.min_span_tokens, "max_tokens": settings.max_span_tokens}
        meta = {
            "format": "kite-upc",
            "kite_version": __version__,
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "fingerprints": fps.to_dict(),
            "model": {"spec": lm.source.spec, "geometry": lm.geometry.to_dict()},
            "source": {"name": source_name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                       "chars": len(text), "tokens": n_tokens},
            "n_tokens": n_tokens,
            "codec": fit_codec.to_json(),
            "spans": spans,
            "clusters": [asdict(c) for c in clusters],
            "tagger": describe_tagger(tagger),
            "raw_kv_bytes_fp16": raw_kv,
        }
        if part_ratios:
            # each cluster's own ratio; loaders see the parts' widths (a GPU load decodes on the host)
            for c, r in zip(meta["clusters"], part_ratios):
                c["ratio"] = r
            meta["label_ratios"] = {"default": default_ratio, "labels": dict(sorted(settings.label_ratios.items()))}
        if regenerator is not None:
            # sides: how many of the (layer or group, K|V) codecs took the regenerator's basis
            meta["regenerator"] = {"fingerprint": regenerator.fingerprint, "sides": regenerated[0]}
            if regenerator.grouped:   # one codec and one part per (cluster, group, side), under its first layer
                meta["layer_groups"] = [list(g) for g in regenerator.layer_groups]
        if entropy_tables[0] is not None:   # the tables of its entropy-coded parts (the blob index says which)
            meta["entropy"] = entropy_tables[0]
        if settings.layer_weights is not None:   # named as the address names them (they weigh only a state-wide budget)
            meta["layer_weights"] = {"fingerprint": settings.layer_weights.fingerprint}
        if tail:      # run through the model at load, after the rest (docs/upc-format.md, "Recomputed tail")
            meta["recompute"] = {"tokens": tail, "ids": list(all_ids[-tail:])}
        if address:
            meta["address"] = address_for(fps.combined, all_ids, settings, meta["tagger"],
                                          None if regenerator is None else regenerator.fingerprint,
                                          tenant).to_header()
        return meta

    def container_bytes(sets) -> int:
        """What the container will take besides the blobs (the codec's state-wide budget counts it):
        the header as it will be written for these clusters, its blob index estimated."""
        keys = [blob_key(c, layer, side) for layer in leads
                for c, side in [(None, None)] + [(c, side) for c in range(len(sets)) for side in "KV"]]
        return header_estimate(state_meta(), keys, raw_kv / (ratio_of(fit_codec) or 1.0))

    t = time.perf_counter()
    n_layers = lm.geometry.n_layers
    grouped = regenerator is not None and regenerator.grouped
    leads = [a for a, _ in regenerator.layer_groups] if grouped else list(range(n_layers))
    if device is None and torch.device(lm.device).type == "cuda":
        device = lm.device
    # a state made on a GPU is served from one: big blobs stay raw unless zstd saves a lot (load speed)
    gpu = device is not None and torch.device(device).type == "cuda"
    writer = StateWriter(large_min_saving=LARGE_MIN_SAVING if gpu else MIN_SAVING)
    part_ratios: list[float] = []
    fit_codec = settings.codec
    batched = device is not None and codec.supports_batched(settings.codec) and not settings.label_ratios \
        and (regenerator is None or codec.batched_takes_regenerator(regenerator, settings.codec))
    sets_once: list[list[torch.Tensor]] = []

    def token_sets_once() -> list[torch.Tensor]:
        if not sets_once:
            sets_once.append(cluster_spans())
        return sets_once[0]   # (called once; a list so the batched codec may call it from its fit)

    def regenerated_layer(layer: int) -> dict:
        K, V = cap.keys_pre[layer], cap.values[layer]
        return regenerator.layer(layer, probe.metric(layer, K, V) if probe else None)

    def code(bonus: int = 0) -> list[tuple[str, bytes]]:
        """Every blob of the state under its key. ``bonus``: bytes the state-wide budget may spend
        beyond the ratio's (what the entropy coding of an earlier pass saved)."""
        def overhead(sets) -> int:
            # the recomputed tail's tokens count in the ratio's base (the whole document's raw KV) and
            # are not coded: their share of the bytes goes to the tokens before them
            fit = ratio_of(fit_codec)
            return container_bytes(sets) - bonus - (int(raw_kv * tail / n_tokens / fit) if tail and fit else 0)

        stage = "compress" if not bonus else "compress again (to the ratio's bytes)"   # progress

        if batched:
            enc = codec.encode_state(cap.keys_pre, cap.values, sets_once[0] if sets_once else token_sets_once,
                                     settings.codec, device=device, overhead_bytes=overhead,
                                     regenerator=regenerator, layer_weights=settings.layer_weights)
            regenerated[0] = enc.info["regenerated_sides"]
            if progress:
                progress(stage, n_layers, n_layers)
            return enc.items()
        token_sets = token_sets_once()
        if grouped:
            return code_groups(token_sets, overhead(token_sets), stage)
        items = []
        # one budget for the whole state: every layer's PCA first, then the allocation over all of them
        whole = (codec.fit_state(cap.keys_pre, cap.values, fit_codec, token_sets,
                                 overhead_bytes=overhead(token_sets),
                                 layer_kwargs=None if regenerator is None else regenerated_layer,
                                 layer_weights=settings.layer_weights)
                 if codec.state_budgeted(fit_codec) and not part_ratios else None)
        regenerated[0] = 0
        for layer in range(n_layers):
            K, V = cap.keys_pre[layer], cap.values[layer]
            lc = whole[layer] if whole is not None else codec.fit_layer(
                K, V, fit_codec, **({} if regenerator is None else regenerated_layer(layer)))
            regenerated[0] += sum(lc.meta[side]["mode"] == "rpca" for side in ("k", "v"))
            items.append((blob_key(None, layer), codec.to_bytes(lc)))
            for c, idx in enumerate(token_sets):
                widths = None
                if part_ratios and part_ratios[c] != fit_ratio:
                    widths = {side: part_widths(lc, side, X[:, idx], part_ratios[c], from_ratio=fit_ratio,
                                                positions=idx) for side, X in (("k", K), ("v", V))}
                part = codec.encode(lc, K[:, idx], V[:, idx], idx, widths)
                items += [(blob_key(c, layer, "K"), codec.to_bytes(part.k)),
                          (blob_key(c, layer, "V"), codec.to_bytes(part.v))]
            if progress:
                progress(stage, layer + 1, n_layers)
        return items

    def code_groups(token_sets, overhead_bytes: int, stage: str) -> list[tuple[str, bytes]]:
        """Every blob of a state coded on bases across layers: per group its codec and parts."""
        fits = groups.fit_groups(cap.keys_pre, cap.values, fit_codec, token_sets, regenerator,
                                 overhead_bytes=overhead_bytes)
        regenerated[0] = 2 * len(fits)
        parts = list(groups.encode_groups(fits, token_sets))
        data = iter(codec.to_bytes_many([fit.codec for fit in fits] + [b for *_, part in parts for b in (part.k, part.v)]))
        layer_blobs = {fit.lead: next(data) for fit in fits}
        items = []
        for a, c, part in parts:
            if c == 0:      # in file order, a group's codec then its parts (as a layer's)
                items.append((blob_key(None, a), layer_blobs[a]))
            items += [(blob_key(c, a, "K"), next(data)), (blob_key(c, a, "V"), next(data))]
        if progress:
            progress(stage, n_layers, n_layers)
        return items

    entropy_tables: list[dict | None] = [None]
    if not batched:
        token_sets_once()
        if settings.label_ratios:
            # the layers are fitted at the lowest ratio in play (every label can reach its own);
            # a cluster at another ratio gets its own widths on those columns
            part_ratios = [settings.label_ratios.get(c.label, default_ratio) for c in clusters]
            if min(part_ratios) < default_ratio:
                fit_codec = at_ratio(settings.codec, min(part_ratios))
        t = time.perf_counter()
    fit_ratio = ratio_of(fit_codec)
    if codec.state_budgeted(fit_codec) and not part_ratios:
        # the budget counts every byte as coded, so the blobs are stored as coded: zstd would make the
        # file smaller than asked by what it happens to save (more on the CPU's writer, which tries it
        # on every blob, than on the GPU's), and it costs every load its decompression
        writer = StateWriter(zstd=False)
    # the bytes the blobs may take at the ratio: a coding that misses them is made again with the miss
    budget = ((lambda: raw_kv / fit_ratio - container_bytes(token_sets_once()))
              if codec.state_budgeted(fit_codec) and not part_ratios and fit_ratio else None)
    if settings.entropy_coding:
        stored, entropy_tables[0], timings["entropy"] = entropy.coded_within(code, budget)
        writer.add_stored(stored)
    else:   # stored as coded (no zstd) when budgeted: the blobs' bytes are the file's
        writer.add_many(codec.within_budget(code, lambda items: sum(len(b) for _, b in items), budget))
    # batched: the fit ran while the spans were clustered, so that time is in both figures
    timings["compress"] = (time.perf_counter() - t) * 1e3

    meta = state_meta()
    t = time.perf_counter()
    size = writer.write(output, meta)
    timings["write"] = (time.perf_counter() - t) * 1e3
    asked = default_ratio if not part_ratios else None
    return CompressResult(path=str(output), n_tokens=n_tokens, clusters=clusters, state_bytes=size,
                          raw_kv_bytes=raw_kv, timings_ms={k: round(v, 1) for k, v in timings.items()},
                          spans=meta["spans"],
                          address=meta["address"]["id"] if address else None, ratio_asked=asked,
                          warnings=ratio_warnings(n_tokens, raw_kv / size, asked, fit_codec.max_bits),
                          recomputed_tokens=tail)


def tail_of(settings: CompressSettings, n_tokens: int) -> int:
    """How many of an ``n_tokens``-token document's last tokens its state keeps as ids for its loads
    to recompute, by ``settings.recompute_tokens`` (``auto``: by the codec's ratio, kite.upcycle.tail)."""
    return recomputed_tail(n_tokens, settings.recompute_tokens, ratio_of(settings.codec))


def capture_head(cap: Capture, n: int) -> Capture:
    """``cap``'s first ``n`` tokens (the text whole: the tokens' offsets still index it)."""
    return replace(cap, ids=cap.ids[:n], offsets=cap.offsets[:n],
                   keys_pre=[k[:, :n].contiguous() for k in cap.keys_pre],
                   values=[v[:, :n].contiguous() for v in cap.values],
                   hidden={layer: h[:n].contiguous() for layer, h in cap.hidden.items()}, cache=None)


RATIO_TOLERANCE = 0.03   # a state's file ratio this close to the ratio asked is that ratio


def ratio_warnings(n_tokens: int, ratio: float, asked: float | None, max_bits: int) -> list[str]:
    """Why a state's file ratio is not the ratio asked (more than RATIO_TOLERANCE off), in a line:
    the document's floor (a short document at a high ratio), every component at its most bits (a
    ratio near 2 or below), or codings that missed the budget. Empty when it is the ratio asked, or
    when no single ratio was asked."""
    if asked is None or abs(ratio / asked - 1) <= RATIO_TOLERANCE:
        return []
    if ratio < asked:
        return [f"the state is {ratio:.1f}× smaller than raw fp16 KV, not the {asked:g}× asked: at {n_tokens:,} "
                "tokens, what every state stores besides its coded components (headers, each layer's means "
                "and bit tables, the exact first token) takes more than that"]
    if asked * max_bits < 16 * 1.1:     # fp16 values at max_bits bits each, and the fixed bytes: no more to spend
        return [f"the state is {ratio:.2f}× smaller than raw fp16 KV, not the {asked:g}× asked: every component "
                f"is coded at its most bits ({max_bits}), so a larger state would keep nothing more "
                "(--precision fp16 keeps the KV as it is)"]
    return [f"the state is {ratio:.2f}× smaller than raw fp16 KV, not the {asked:g}× asked: its codings did not "
            "take the rest of the ratio's bytes"]
