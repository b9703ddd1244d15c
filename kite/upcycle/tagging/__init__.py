"""Semantic tagging: name each span's (or cluster's) clause type from a few labeled examples.

Two families of methods, one chosen by cross-validation on the labeled examples:

- **Hidden-state classifiers** (`ridge`, `centroid`): a text's embedding is the mean of the model's
  own hidden states over its tokens at one layer (index `h` = output of decoder layer `h`; 0 is
  the token embeddings), z-scored with the examples' mean and spread (a few "massive activation"
  dimensions otherwise swamp every distance). `ridge` is a one-vs-rest ridge regression in dual
  form; `centroid` is cosine similarity to each label's mean. Z-scored ridge stays accurate from
  very few examples per label, where cosine to raw centroids does not (docs/tagging.md).
- **Calibrated prompt scoring** (`prompt`): a few-shot prompt ("Clause: …\\nType: <label>"), each
  label's log-probability minus its log-probability after a content-free input (contextual
  calibration). Worth it on capable models, not on small ones (docs/tagging.md), so by default
  it is a candidate only for models of ≥ 1B parameters (`methods=` overrides).

Confidences are a temperature-scaled softmax of the chosen method's scores, the temperature fitted
on the out-of-fold scores. Labels and examples are sorted before anything is computed, so the
order of the labels list (or of the examples) never changes a prediction.

`ClauseTagger.embedding_layers` says which hidden states the classifier reads, so the compress
pipeline can pool spans from the document's own prefill (`pool_spans`) instead of re-embedding
span texts. Deeper layers mix in the surrounding document, so `fit` embeds every example twice,
alone and from inside a pseudo-document of other examples, trains on both views and scores both
in cross-validation. Both uses are measured by `evaluate_tagging(..., mode="both")`
(docs/tagging.md).

**Queries** are not clauses: a head fitted and temperature-calibrated on clause texts is confident
about any question, off-topic ones included. `fit_queries` adds a `QueryHead`: a ridge head with
one more class, "no clause type", fitted on labeled *questions* (kite.data.traffic
`calibration_queries`), its layer, λ and temperature chosen by cross-validation that keeps each
phrasing's variants in one fold. `predict_queries` spreads the "no clause" probability evenly
over the clause labels, so a vague or off-topic question has a high label entropy and no label.

Modules: `tagger` (ClauseTagger, QueryHead, TagResult), `hidden` (hidden states per layer, pooled
over texts), `fit` (the classifier maths and the cross-validated choice), `prompt` (the prompt
scorer), `build` (the tagger an upcycle config asks for, cached), `evaluate` (accuracy against
ground truth).
"""

from kite.upcycle.tagging.build import (
    build_tagger,
    calibration_set,
    config_examples,
    describe_tagger,
)
from kite.upcycle.tagging.evaluate import (
    char_spans_to_token_spans,
    embed_spans_in_document,
    evaluate_queries,
    evaluate_tagging,
)
from kite.upcycle.tagging.fit import candidate_layers, fit_temperature, query_candidate_layers
from kite.upcycle.tagging.hidden import hidden_states_at
from kite.upcycle.tagging.prompt import PromptScorer
from kite.upcycle.tagging.tagger import ClauseTagger, QueryHead, TagResult

__all__ = ["ClauseTagger", "PromptScorer", "QueryHead", "TagResult", "build_tagger",
           "calibration_set", "candidate_layers", "char_spans_to_token_spans", "config_examples",
           "describe_tagger", "embed_spans_in_document", "evaluate_queries", "evaluate_tagging",
           "fit_temperature", "hidden_states_at", "query_candidate_layers"]
