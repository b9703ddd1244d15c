"""`kite upcycle train`: the regenerator (per-model calibrated bases) and the LoRA reader adapter."""

from kite.upcycle.train.data import Pair, read_pairs, split_pairs
from kite.upcycle.train.regenerator import Regenerator, RegeneratorFit

__all__ = ["Pair", "Regenerator", "RegeneratorFit", "read_pairs", "split_pairs"]
