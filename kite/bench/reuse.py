"""What consecutive bench runs on one model and one case set share (`kite tune`'s points): the
loaded model, the tagger, each document's prefill time and full prefill's answer to each case.

Full prefill is the reference every delta is measured against and depends on nothing a point
varies (compression, clusters, rules, `yoco_min_hit_gain`), so a run given a :class:`BenchReuse`
computes it once per case and later runs read it back; a later run that needs nothing else from
a document's full cache (only `full`, `state` and `fused`) does not prefill the document at all.
States are reused by `kite.bench.states.ensure_state` (same folder, same settings), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reference:
    """Full prefill's answer to one case, as a run measured it."""

    row: dict  # the `full` method's entry in the case's row
    logits: Any  # the reference's logits after full prefill [len(reference), vocab]
    ppl_no_document: float
    cost_ms: float  # what computing it took: the answer, the reference's logits, the no-document PPL


@dataclass
class BenchReuse:
    """Kept between `run_bench` calls (pass the same object to each). Every key names the model
    (its combined fingerprint) and what the answer depends on, so another model, prompt or
    answer length never reads an entry that is not its own."""

    models: dict[tuple, tuple[Any, float]] = field(default_factory=dict)  # key → (lm, load ms)
    taggers: dict[str, Any] = field(default_factory=dict)
    prefills_ms: dict[tuple, float] = field(default_factory=dict)  # (fingerprint, document key) → ms
    references: dict[tuple, Reference] = field(default_factory=dict)

    def model(self, key: tuple):
        """(lm, load ms) loaded earlier under `key`, or None."""
        return self.models.get(key)

    @staticmethod
    def reference_key(fingerprint: str, case, prompt_ids: list[int], max_new_tokens: int) -> tuple:
        return (fingerprint, case.id, case.document_key, case.reference, tuple(prompt_ids), max_new_tokens)
