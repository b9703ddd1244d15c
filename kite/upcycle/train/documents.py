"""Each document of a training run once: one prefill, its states at every training ratio, their
prefixes rebuilt on the model's device, and its pairs' teacher.

The document's capture (:func:`kite.upcycle.compress.captures_for`, with the model's cache kept: on a
GPU several documents a forward; for a training document, the regenerator's calibration's when it
fit in memory: :class:`CaptureStore`)
serves every ratio's compression and the teacher, which continues the same cache; a state already
in the run folder (a resumed run) is not made again. The states are the files the run keeps; each
is loaded from its file once (the load a user's state goes through) and kept decoded on the device
(:class:`~kite.upcycle.train.adapter.PrefixCache`) for every step and epoch that reads it.

With a GPU the states are coded on the device by the batched codec
(:func:`kite.upcycle.codec.encode_state`), which takes an unweighted regenerator choosing by the
expected error and writes the per-layer codec's bytes. A regenerator it does not take (weighted, or
choosing by measured error or the attention probe) goes through the per-layer codec, whose many small
operations run faster on a host core than as GPU launches (9 s per 2K-token state of the embedded
model on the H200's device, 2.8 s on one core of the dev CPU, both 2026-12-02, 16x): those states are
coded on the host, by a few threads, while the GPU prefills the next documents and computes their
teachers.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kite.runtime.cache import cache_layers
from kite.upcycle.capture import Capture
from kite.upcycle.codec import batched_takes_regenerator
from kite.upcycle.codec.settings import settings_for
from kite.upcycle.compress import CompressSettings, captures_for, compress_document
from kite.upcycle.load.prefix import load_prefix, load_prefixes
from kite.upcycle.train.adapter import Example, PrefixCache, memory_budget
from kite.upcycle.train.data import Pair
from kite.upcycle.train.stages import StageTimes
from kite.upcycle.train.teacher import TEACHER_ROWS, document_examples

if TYPE_CHECKING:
    from kite.model import LoadedModel

# Documents whose states are loaded onto the device at a time, their recomputed tails run together
# where the device batches forwards (kite.upcycle.load.load_prefixes); a GPU's forward holds about 7
# of 2K tokens (kite.runtime.batch.BATCH_TOKENS), so 16 make two full forwards and a short one.
LOAD_TOGETHER = 16


def capture_nbytes(cap: Capture) -> int:
    """What a capture holds: its KV (fp32), its hidden states and the model's cache, in bytes."""
    ts = [*cap.keys_pre, *cap.values, *cap.hidden.values(), *cap.query_tail]
    if cap.cache is not None:
        ts += [t for kv in cache_layers(cap.cache) for t in kv]
    return sum(t.numel() * t.element_size() for t in ts)


class CaptureStore:
    """The calibration's captures, kept for the document pass while they fit in ``budget_bytes`` (a
    training document is then prefilled once in the whole run); each is taken once."""

    def __init__(self, budget_bytes: int):
        self.budget, self.nbytes, self.items = budget_bytes, 0, {}

    def offer(self, doc: str, cap: Capture) -> None:
        n = capture_nbytes(cap)
        if self.nbytes + n <= self.budget:
            self.items[doc] = (cap, n)
            self.nbytes += n

    def __contains__(self, doc: str) -> bool:
        return doc in self.items

    def take(self, doc: str) -> Capture | None:
        cap, n = self.items.pop(doc, (None, 0))
        self.nbytes -= n
        return cap

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class Prepared:
    """What the adapter's training and the report read: the state files, each ratio's decoded
    prefixes by document, and the teacher's examples in the order of the pairs."""

    states: dict[tuple[str, float], Path]
    prefixes: dict[float, PrefixCache] = field(default_factory=dict)
    examples: list[Example] = field(default_factory=list)
    held_examples: list[Example] = field(default_factory=list)
    made: int = 0          # states compressed by this run (the rest were in the folder)
    compress_ms: dict[str, float] = field(default_factory=dict)   # compress_document's own timings, summed


def state_path(out: Path, doc: str, ratio: float) -> Path:
    return out / "states" / f"{doc}-r{ratio:g}.upc"


def compress_settings(cfg, ratio: float, layer_weights=None) -> CompressSettings:
    """A training state's settings: the config's clusters and spans, ``ratio``'s codec, and the layer
    weights the run codes with (kite.upcycle.pipeline.layer_weights_for: what states of the model are
    coded with outside training, so the adapter learns to read the states it will meet), and the
    config's recomputed tail (what a load of them reads)."""
    c = cfg.compression
    return CompressSettings(codec=settings_for(ratio), n_clusters=c.cluster_num, min_span_tokens=c.min_span_tokens,
                            max_span_tokens=c.max_span_tokens, layer_weights=layer_weights,
                            recompute_tokens=c.recompute_tokens)


def on_host(cap: Capture) -> Capture:
    """The capture's KV, hidden states and queries on the host (for the codec there), without the
    model's cache."""
    return dataclasses.replace(cap, keys_pre=[k.cpu() for k in cap.keys_pre], values=[v.cpu() for v in cap.values],
                               hidden={k: h.cpu() for k, h in cap.hidden.items()},
                               query_tail=[q.cpu() for q in cap.query_tail], cache=None)


def codec_workers_for(device, regenerator=None, ratios=()) -> int:
    """Host threads that code states while the device goes on: on the CPU none (the model's own
    forwards need the cores); on a GPU none when the batched codec takes the regenerator at every
    training ratio, or the regenerator's bases span layers (their products are the device's work: the
    states are coded on the device, in turn), else up to 8 (half the cores)."""
    if torch.device(device).type != "cuda":
        return 0
    if regenerator is not None and (regenerator.grouped or ratios and all(
            batched_takes_regenerator(regenerator, settings_for(r)) for r in ratios)):
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def prepare_documents(lm: LoadedModel, pairs: list[Pair], train: list[Pair], held: list[Pair], reg, cfg,
                      ratios: list[float], out: Path, times: StageTimes, *, teacher: bool, top_k: int = 256,
                      rows: int = TEACHER_ROWS, progress=None, kept: CaptureStore | None = None,
                      codec_workers: int = 0, layer_weights=None) -> Prepared:
    """Every document's states (made where missing) and, with ``teacher``, its prefixes and its pairs'
    teacher examples (``train`` and ``held`` in their own orders). ``kept``: captures made already
    (:func:`captures_for` with the cache kept, e.g. by the regenerator's calibration), used instead
    of prefilling those documents again. ``codec_workers`` > 0: the states are coded on the host by
    that many threads (each capture copied there) while the device prefills the next documents and
    computes the teachers; the prefixes are loaded once every state is written. ``layer_weights``:
    what the states' bit allocations weigh layers by (:func:`compress_settings`)."""
    docs: dict[str, Pair] = {}
    for p in pairs:
        docs.setdefault(p.document_key, p)
    by_doc: dict[str, list[tuple[str, int]]] = {}
    for name, group in (("train", train), ("held", held)):
        for i, p in enumerate(group):
            by_doc.setdefault(p.document_key, []).append((name, i))
    prep = Prepared(states={(doc, r): state_path(out, doc, r) for doc in docs for r in ratios})
    if teacher:
        param = next(lm.model.parameters())
        budget = memory_budget(param.device, 0.5) // max(1, len(ratios))
        prep.prefixes = {r: PrefixCache(lambda doc, r=r: load_prefix(prep.states[(doc, r)], lm)[0], budget,
                                        param.device, param.dtype,
                                        lambda docs, r=r: [p for p, _ in load_prefixes([prep.states[(d, r)] for d in docs], lm)])
                         for r in ratios}
    slots: dict[str, list[Example | None]] = {"train": [None] * len(train), "held": [None] * len(held)}
    settings0 = compress_settings(cfg, ratios[0], layer_weights)
    if reg.choice == "probe":
        codec_workers = 0     # the attention probe reads the model where it is: coded in turn, on its device
    pool = ThreadPoolExecutor(codec_workers, thread_name_prefix="kite-codec") if codec_workers > 0 else None
    jobs: list[Future] = []

    def compress(doc: str, text: str, ratio: float, cap: Capture) -> None:
        made = compress_document(lm, text, prep.states[(doc, ratio)], compress_settings(cfg, ratio, layer_weights),
                                 source_name=f"train:{doc}", regenerator=reg, captured=cap)
        with lock:
            prep.made += 1
            for k, v in made.timings_ms.items():
                if k != "prefill":     # the shared capture's, counted once in its own stage
                    prep.compress_ms[k] = round(prep.compress_ms.get(k, 0.0) + v, 1)

    lock = threading.Lock()
    loading: list[str] = []      # documents whose states are written, their prefixes not yet loaded

    def load(docs: list[str]) -> None:
        """The documents' states onto the device, each ratio's together (their tails in shared forwards)."""
        for r in ratios:
            with times.stage("load", len(docs)):
                prep.prefixes[r].fetch(docs)

    (out / "states").mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if pool is not None:
        torch.set_num_threads(1)       # the codec's ops are small: one thread each, the workers in parallel
    # per document: the ratios whose states are missing, its pairs for the teacher; and the documents
    # whose capture is made here (none kept, or kept without the probe's queries), several a forward
    plan = {doc: ([r for r in ratios if not prep.states[(doc, r)].exists()], by_doc.get(doc, []) if teacher else [])
            for doc in docs}
    fresh = [doc for doc, (missing, mine) in plan.items()
             if (missing or mine) and (kept is None or doc not in kept or reg.choice == "probe")]
    made = captures_for(lm, [docs[doc].context for doc in fresh], settings0, regenerator=reg, keep_cache=teacher)
    try:
        for n, (doc, first) in enumerate(docs.items()):
            missing, mine = plan[doc]
            cap = kept.take(doc) if kept is not None else None
            if cap is not None and reg.choice == "probe":
                cap = None                                     # made without the probe's queries
            if (missing or mine) and cap is None:
                with times.stage("capture"):                   # a batch of documents' prefill falls to its first
                    cap = next(made)
            if missing and pool is not None:
                with times.stage("capture", 0):                # its copy to the host, for the codec there
                    host = on_host(cap)
                jobs += [pool.submit(compress, doc, first.context, r, host) for r in missing]
            for r in missing if pool is None else []:
                with times.stage("compress"):
                    compress(doc, first.context, r, cap)
            if mine:
                group = [(train if name == "train" else held)[i] for name, i in mine]
                with times.stage("teacher", len(group)):
                    examples = document_examples(lm, group, cap.cache, cap.ids, top_k, rows)
                for (name, i), ex in zip(mine, examples):
                    slots[name][i] = ex
            del cap
            if teacher and pool is None:
                loading.append(doc)
                if len(loading) == LOAD_TOGETHER:
                    load(loading)
                    loading = []
            if progress:
                progress("states", n + 1, len(docs))
        if loading:
            load(loading)
        if pool is not None:
            # the codec ran on the host while the device went on; what is left of it is waited for here
            with times.stage("compress", len(jobs)):
                for job in jobs:
                    job.result()
            torch.set_num_threads(threads)
            if teacher:
                keys = list(docs)
                for i in range(0, len(keys), LOAD_TOGETHER):
                    load(keys[i:i + LOAD_TOGETHER])
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)
    prep.examples = [e for e in slots["train"] if e is not None]
    prep.held_examples = [e for e in slots["held"] if e is not None]
    return prep
