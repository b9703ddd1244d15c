"""KITE: keep the KV work long-context inference throws away (Upcycle) and load it by rule (YOCO)."""

__version__ = "0.1.0"
