"""Each document of a training run once: one prefill, its states at every training ratio, their
prefixes rebuilt on the model's device, and its pairs' teacher.

The document's capture (:func:`kite.upcycle.compress.capture_for`, with the model's cache kept; for
a training document, the regenerator's calibration's when it fit in memory: :class:`CaptureStore`)
serves every ratio's compression and the teacher, which continues the same cache; a state already
in the run folder (a resumed run) is not made again. The states are the files the run keeps; each
is loaded from its file once (the load a user's state goes through) and kept decoded on the device
(:class:`~kite.upcycle.train.adapter.PrefixCache`) for every step and epoch that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kite.runtime.cache import cache_layers
from kite.upcycle.capture import Capture
from kite.upcycle.codec.settings import settings_for
from kite.upcycle.compress import CompressSettings, capture_for, compress_document
from kite.upcycle.load.prefix import load_prefix
from kite.upcycle.train.adapter import Example, PrefixCache, memory_budget
from kite.upcycle.train.data import Pair
from kite.upcycle.train.stages import StageTimes
from kite.upcycle.train.teacher import TEACHER_ROWS, document_examples

if TYPE_CHECKING:
    from kite.model import LoadedModel


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


def compress_settings(cfg, ratio: float) -> CompressSettings:
    c = cfg.compression
    return CompressSettings(codec=settings_for(ratio), n_clusters=c.cluster_num, min_span_tokens=c.min_span_tokens,
                            max_span_tokens=c.max_span_tokens)


def prepare_documents(lm: LoadedModel, pairs: list[Pair], train: list[Pair], held: list[Pair], reg, cfg,
                      ratios: list[float], out: Path, times: StageTimes, *, teacher: bool, top_k: int = 256,
                      rows: int = TEACHER_ROWS, progress=None, kept: CaptureStore | None = None) -> Prepared:
    """Every document's states (made where missing) and, with ``teacher``, its prefixes and its pairs'
    teacher examples (``train`` and ``held`` in their own orders). ``kept``: captures made already
    (:func:`capture_for` with the cache kept, e.g. by the regenerator's calibration), used instead
    of prefilling those documents again."""
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
                                        param.device, param.dtype) for r in ratios}
    slots: dict[str, list[Example | None]] = {"train": [None] * len(train), "held": [None] * len(held)}
    settings0 = compress_settings(cfg, ratios[0])
    for n, (doc, first) in enumerate(docs.items()):
        missing = [r for r in ratios if not prep.states[(doc, r)].exists()]
        mine = by_doc.get(doc, []) if teacher else []
        cap = kept.take(doc) if kept is not None else None
        if cap is not None and reg.choice == "probe":
            cap = None                                     # made without the probe's queries
        if (missing or mine) and cap is None:
            with times.stage("capture"):
                cap = capture_for(lm, first.context, settings0, regenerator=reg, keep_cache=bool(mine))
        if missing or mine:
            for r in missing:
                path = prep.states[(doc, r)]
                path.parent.mkdir(parents=True, exist_ok=True)
                with times.stage("compress"):
                    made = compress_document(lm, first.context, path, compress_settings(cfg, r),
                                             source_name=f"train:{doc}", regenerator=reg, captured=cap)
                prep.made += 1
                for k, v in made.timings_ms.items():
                    if k != "prefill":     # the shared capture's, counted once in its own stage
                        prep.compress_ms[k] = round(prep.compress_ms.get(k, 0.0) + v, 1)
            if mine:
                group = [(train if name == "train" else held)[i] for name, i in mine]
                with times.stage("teacher", len(group)):
                    examples = document_examples(lm, group, cap.cache, cap.ids, top_k, rows)
                for (name, i), ex in zip(mine, examples):
                    slots[name][i] = ex
            del cap
        if teacher:
            for r in ratios:
                with times.stage("load"):
                    prep.prefixes[r](doc)
        if progress:
            progress("states", n + 1, len(docs))
    prep.examples = [e for e in slots["train"] if e is not None]
    prep.held_examples = [e for e in slots["held"] if e is not None]
    return prep
