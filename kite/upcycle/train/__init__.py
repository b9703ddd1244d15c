"""`kite upcycle train`: the training run (calibrating the regenerator, which lives in
kite.upcycle.codec, and training the LoRA reader adapter), its data, checkpoints and report."""

from kite.upcycle.train.data import Pair, read_pairs, split_pairs

__all__ = ["Pair", "read_pairs", "split_pairs"]
