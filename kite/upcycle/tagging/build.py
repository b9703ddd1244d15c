"""Build the clause tagger an upcycle config asks for: examples → fitted ClauseTagger (cached)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kite.errors import BadInput
from kite.paths import cache_dir
from kite.upcycle.tagging.tagger import ClauseTagger

if TYPE_CHECKING:
    from kite.model import LoadedModel

TAGGER_CACHE_VERSION = 2  # 2: taggers carry a query head calibrated on questions
# The query head's calibration set: generated labeled questions (kite.data.traffic
# `calibration_queries`), phrasings the bench and `kite data traffic` never use; seed 1001 like
# the clause examples' 1000 stays clear of the small seeds of the evaluation sets.
QUERY_CALIBRATION_N = 800
QUERY_CALIBRATION_SEED = 1001


def config_examples(cfg, cfg_path: Path | None) -> list[tuple[str, str]]:
    """Labeled examples: the config's list, its examples_file, else generated contracts' clauses."""
    st = cfg.semantic_tagging
    examples = [(e.text, e.label) for e in st.examples]
    if st.examples_file:
        path = Path(st.examples_file)
        if not path.is_absolute() and cfg_path is not None:
            path = cfg_path.parent / path
        from kite.data.jsonl import read_jsonl

        for rec in read_jsonl(path):
            if not isinstance(rec.get("text"), str) or not isinstance(rec.get("label"), str):
                raise BadInput(f"{path}:{rec['_line']}: expected {{\"text\": ..., \"label\": ...}}")
            examples.append((rec["text"], rec["label"]))
    if not examples and st.generated_examples_per_label:
        from kite.data.contracts import labeled_examples

        # Seed 1000: contracts the benchmark and evaluation sets (small seeds) never contain.
        examples = labeled_examples(seed=1000, per_label=st.generated_examples_per_label)
    if st.labels:
        known = set(st.labels)
        unknown = sorted({lab for _, lab in examples if lab not in known})
        if unknown:
            raise BadInput(f"semantic_tagging: example label {unknown[0]!r} is not in labels "
                           f"({', '.join(st.labels)})")
    return examples


def build_tagger(lm: LoadedModel, cfg, cfg_path: Path | None = None, progress=None):
    """A fitted ClauseTagger for `lm`, or None when the config has no labels and no examples."""
    examples = config_examples(cfg, cfg_path)
    labels = list(cfg.semantic_tagging.labels) or sorted({lab for _, lab in examples})
    if not examples:
        return None
    key = hashlib.sha256(json.dumps([TAGGER_CACHE_VERSION, lm.fingerprints.combined, sorted(labels),
                                     examples]).encode()).hexdigest()[:24]
    path = cache_dir() / "taggers" / f"{key}.json"
    if path.exists():
        try:
            return ClauseTagger.from_dict(json.loads(path.read_text()))
        except (ValueError, BadInput):
            pass  # a damaged cache entry is refitted below
    if progress:
        progress("tagger", 0, 1)
    tagger = ClauseTagger.fit(lm.model, lm.tokenizer, examples, labels)
    queries = calibration_set(tagger.labels)
    if queries:
        tagger.fit_queries(lm.model, lm.tokenizer, queries)
    if progress:
        progress("tagger", 1, 1)
    from kite.atomic import write_text

    try:
        write_text(path, json.dumps(tagger.to_dict()))
    except OSError:
        pass
    return tagger


def calibration_set(labels, n: int = QUERY_CALIBRATION_N,
                    seed: int = QUERY_CALIBRATION_SEED) -> list[tuple[str, str | None, str]]:
    """(query, label or None, phrasing) for `fit_queries`: the generated calibration questions,
    when the tagger's labels are the generated contracts' clause types (else none: a tagger of
    other labels keeps its clause head for queries)."""
    from kite.data.clauses import LABELS
    from kite.data.traffic import calibration_queries

    if set(labels) != set(LABELS):
        return []
    return [(r["query"], r["label"], r["group"]) for r in calibration_queries(n, seed)]


def describe_tagger(tagger) -> dict | None:
    """A JSON-able summary of the tagger (method, layers, labels, validation accuracy,
    temperature, query head), as a state's metadata records it; None for no tagger."""
    if tagger is None:
        return None
    out = {"method": tagger.method, "embedding_layers": tagger.embedding_layers,
           "labels": tagger.labels,
           "validation_accuracy": tagger.validation.get("accuracy"),
           "temperature": tagger.temperature}
    if tagger.query_head is not None:
        q = tagger.query_head
        out["query_head"] = {"layers": q.layers, "temperature": q.temperature,
                             "validation_accuracy": q.validation.get("accuracy")}
    return out
