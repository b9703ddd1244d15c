"""How a coding of a document's KV is measured against the full context: the held-out documents
and their scoring, the key-coding variants and the lanes variants the quality benchmarks compare
(benchmarks/regenerator_quality.py, post_rope_keys.py, lanes_quality.py, adapter_oracle.py).
A face of its own: benchmarks and tests import these names from here."""

from kite.upcycle.study.held_out import (CALIBRATION_LICENSES, CONTINUATION, HELD_OUT, LICENSES, Document,
                                         context_tokens, held_out_docs, prepare_document, relative_error)
from kite.upcycle.study.key_coding import MODES, WHERE, coded_keys, variance_fractions
from kite.upcycle.study.state_fuzz import BAD_OUTCOMES, OUTCOMES, Outcome, counts, fuzz_states, make_fuzz_state
from kite.upcycle.study.lanes import lanes_cells, lanes_prefix, lanes_variants, score_cell, worst_first

__all__ = [
    "BAD_OUTCOMES", "CALIBRATION_LICENSES", "CONTINUATION", "OUTCOMES", "Outcome", "counts", "fuzz_states", "make_fuzz_state", "HELD_OUT", "LICENSES", "MODES", "WHERE", "Document", "coded_keys",
    "context_tokens", "held_out_docs", "lanes_cells", "lanes_prefix", "lanes_variants", "prepare_document",
    "relative_error", "score_cell", "variance_fractions", "worst_first",
]
