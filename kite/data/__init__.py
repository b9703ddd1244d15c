"""Synthetic data with ground truth: contracts, their clause spans and questions (bench cases)."""

from kite.data.clauses import CLAUSE_TYPES, LABELS, ClauseType
from kite.data.contracts import generate_contract, generate_contracts, labeled_examples, to_jsonl
from kite.data.jsonl import read_cases, read_jsonl

__all__ = ["CLAUSE_TYPES", "LABELS", "ClauseType", "generate_contract", "generate_contracts",
           "labeled_examples", "to_jsonl", "read_cases", "read_jsonl"]
