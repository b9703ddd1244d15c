"""`kite upcycle train --layer-group auto`: how many adjacent layers one calibrated basis spans,
chosen by measured error at equal bytes.

Bases across more layers see how the layers' KV move together (KVTC's PCA over heads and layers)
and cost more to fit, store and apply; which grouping pays differs by model and ratio. The run
measures it: the calibration's sums are taken once over the widest group (:data:`MAX_WIDTH`
features at most), every grouping that divides it is a slice of those sums
(:meth:`kite.upcycle.codec.RegeneratorFit.regroup`), and each candidate's bases code a few training
documents the calibration left out, at every training ratio (so at the same bytes), as the run would
code its states. The candidate whose states leave the lowest mean KL of the model's next-token
distributions against the full context's, over those documents' continuations, is kept; the
documents are then added to the calibration and its bases fitted on all of them. Each is prefilled
once: its capture keeps the model's cache, which the full context's logits continue, and the same
capture is coded by every candidate and then added to the calibration.

The candidates are measured widest first, and the search stops at the first that is no better than
the best so far (:func:`descend`): on the models and ratios measured, the error falls with the span
(SmolLM2 at 16x: KL 0.093 per layer down to 0.0043 over all 30 layers, docs/training.md), so a run
usually measures two groupings, not every divisor; where narrower bases win, it goes on down.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kite.errors import BadInput
from kite.upcycle.codec.regenerator import Regenerator, RegeneratorFit
from kite.upcycle.capture import Capture
from kite.upcycle.compress import CompressSettings
from kite.upcycle.quality import compare_logits, full_logits, state_logits

MAX_WIDTH = 16384       # features one basis may span (a float64 Gram of 2 GiB a side while fitting)
MAX_DOCUMENTS = 2       # training documents the choice is measured on (every one of 4 ranked the groupings alike)


def candidate_groups(n_layers: int, layer_width: int, max_width: int = MAX_WIDTH) -> list[int]:
    """The groupings measured: every divisor of the widest group of at most ``max_width`` features
    (``layer_width``: one layer's keys, or values, of every head) that divides the model's layers,
    1 (a basis per layer) first."""
    widest = max(g for g in range(1, n_layers + 1) if n_layers % g == 0 and (g == 1 or g * layer_width <= max_width))
    return [g for g in range(1, widest + 1) if widest % g == 0]


def validation_documents(keys: list[str], seed: int) -> list[str]:
    """The training documents (their keys) the choice is measured on and the first calibration
    leaves out: a seeded draw of about a fifth of them, 1 to :data:`MAX_DOCUMENTS`, at least one
    left to calibrate on. BadInput for fewer than two."""
    if len(keys) < 2:
        raise BadInput(f"--layer-group auto: {len(keys)} training document; the choice is measured on documents "
                       "the calibration leaves out, so it needs at least 2 (or give --layer-group N)")
    n = min(MAX_DOCUMENTS, max(1, len(keys) // 5))
    return sorted(random.Random(f"kite-layer-group:{seed}").sample(sorted(keys), n))


@dataclass
class GroupChoice:
    """What ``--layer-group auto`` measured: each candidate's mean KL (and per document and ratio).
    No timings: it goes into the regenerator's fingerprinted meta, and a run on the same documents
    must fingerprint the same bases the same (the search's seconds: the run's ``calibrate_choose``)."""

    chosen: int
    candidates: list[dict] = field(default_factory=list)   # {"layer_group", "kl", "kl_by_document"}
    documents: int = 0
    ratios: list[float] = field(default_factory=list)
    not_measured: list[int] = field(default_factory=list)   # narrower groupings the search stopped before

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "measured": "mean KL of the continuation against the full context, states "
                "at each training ratio", "search": "widest first, stopping at the first grouping no better than "
                "the best so far", "documents": self.documents, "ratios": self.ratios,
                "candidates": self.candidates, "not_measured": self.not_measured}


def descend(groups: list[int], measure: Callable[[int], float]) -> tuple[dict[int, float], int]:
    """``measure`` each of ``groups`` widest first until one is no better than the best so far:
    ({group: error} of those measured, the best; the smaller group on a tie)."""
    errors: dict[int, float] = {}
    for g in sorted(groups, reverse=True):
        best = min(errors.values(), default=None)
        errors[g] = measure(g)
        if best is not None and errors[g] >= best:
            break
    return errors, min(errors, key=lambda g: (errors[g], g))


def choose_layer_group(lm, fit: RegeneratorFit, documents: list[tuple[Capture, list[int]]], ratios: list[float],
                       finish: Callable[[RegeneratorFit], Regenerator],
                       settings: Callable[[int, float], CompressSettings], progress=None) -> GroupChoice:
    """Measure the groupings that divide ``fit``'s (:func:`candidate_groups`), widest first
    (:func:`descend`): a grouping's bases (``finish(fit.regroup(g))``) code each of ``documents``
    ((the context's capture, made with the model's cache kept; continuation ids), none calibrated
    on) at each of ``ratios`` with ``settings(g, ratio)``; the lowest mean KL wins (the smaller group
    on a tie). The full context's logits continue each capture's cache, which is then cut back to
    the context (the caller may go on using the capture). ``progress(stage, done, total)`` after
    each candidate measured."""
    if not documents:
        raise ValueError("no documents to measure the layer groups on")
    if any(cap.cache is None for cap, _ in documents):
        raise ValueError("the layer groups are measured on captures made with the model's cache kept")
    groups = [g for g in range(1, fit.layer_group + 1) if fit.layer_group % g == 0]
    full = []
    for cap, cont in documents:
        full.append(full_logits(lm, cap.ids, cont, cache=cap.cache))
        cap.cache.crop(-len(cont))          # back to the context alone
    rows = {}

    def measure(g: int) -> float:
        reg = finish(fit.regroup(g))
        by_doc = []
        for (cap, cont), base in zip(documents, full):
            targets = torch.tensor(cont[1:])
            kls = [compare_logits(base, state_logits(lm, cap.ids, cont, settings(g, r), regenerator=reg,
                                                     captured=cap)[0], targets)["kl_mean"] for r in ratios]
            by_doc.append(round(sum(kls) / len(kls), 6))
        rows[g] = {"layer_group": g, "kl": round(sum(by_doc) / len(by_doc), 6), "kl_by_document": by_doc}
        del reg
        if progress:
            progress("regenerator (layer groups)", len(rows), len(groups))
        return rows[g]["kl"]

    _, chosen = descend(groups, measure)
    if progress and len(rows) < len(groups):
        progress("regenerator (layer groups)", len(rows), len(rows))     # the search stopped: the bar ends full
    return GroupChoice(chosen=chosen, candidates=[rows[g] for g in sorted(rows)], documents=len(documents),
                       ratios=[float(r) for r in ratios], not_measured=[g for g in groups if g not in rows])


__all__ = ["GroupChoice", "MAX_DOCUMENTS", "MAX_WIDTH", "candidate_groups", "choose_layer_group", "descend",
           "validation_documents"]
