"""Held-out documents and how a coding of their KV is scored against the full context: the
measurement the quality benchmarks share (benchmarks/regenerator_quality.py, lanes_quality.py,
post_rope_keys.py, adapter_oracle.py).

Held out: licenses under /usr/share/common-licenses no calibration reads and generated contracts of
a seed calibration never draws; a document of n tokens is scored on its ``CONTINUATION`` tokens
after its first ``context_tokens(n)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kite.data.contracts import generate_contracts
from kite.runtime.cache import KVPrefix, new_cache
from kite.runtime.generate import forward_tokens
from kite.upcycle.capture import capture, tokenize_document
from kite.upcycle.quality import compare_logits, full_logits
from kite.upcycle.rope import apply_rope, rope_cos_sin

LICENSES = Path("/usr/share/common-licenses")
CALIBRATION_LICENSES = ("GFDL-1.3", "MPL-2.0", "Artistic", "CC0-1.0", "LGPL-2.1", "MPL-1.1")
HELD_OUT = ("GPL-3", "Apache-2.0")
CONTINUATION = 512      # tokens scored after the state


def context_tokens(n: int) -> int:
    """A held-out document of ``n`` tokens: its first this many are the state's context."""
    return min(2048, n - CONTINUATION)


def held_out_docs(contracts: int, licenses=HELD_OUT) -> dict[str, str]:
    docs = {name: (LICENSES / name).read_text() for name in licenses}
    for rec in generate_contracts(contracts, tokens=2700, seed=23):
        docs[rec["id"]] = rec["text"]
    return docs


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    """Per layer: ||a - b|| / ||b||."""
    return [round(float((x - y).norm() / y.norm().clamp_min(1e-30)), 4) for x, y in zip(a, b)]


@dataclass
class Document:
    """One held-out document prepared for scoring: its context prefilled and captured (keys pre- and
    post-RoPE, values), the continuation's logits after the full context."""

    lm: object
    name: str
    n_ctx: int
    cont: list[int]
    targets: torch.Tensor
    full: torch.Tensor          # the continuation's logits after the full context
    cap: object                 # kite.upcycle.capture's Captured: keys_pre, values per layer [H, T, d]
    cos: torch.Tensor
    sin: torch.Tensor
    keys_post: list[torch.Tensor]

    @property
    def raw_bytes(self) -> int:
        """The context's K and V in fp16."""
        return 2 * sum(k.numel() for k in self.cap.keys_pre) * 2

    @torch.inference_mode()
    def score(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> dict:
        """The continuation teacher-forced after a prefix of these (post-RoPE) keys and values, against
        the full context: compare_logits' metrics plus the per-token KL's median and maximum."""
        prefix = KVPrefix(keys=keys, values=values, next_position=self.n_ctx)
        got = forward_tokens(self.lm.model, self.cont, new_cache(self.lm.model, prefix), self.n_ctx)[:-1]
        # the mean KL is compare_logits'; a few tokens that copy from the context can dominate it, so
        # the per-token median and maximum go beside it
        lp_full, lp_got = torch.log_softmax(self.full, -1), torch.log_softmax(got, -1)
        kl = (lp_full.exp() * (lp_full - lp_got)).sum(-1)
        return {**compare_logits(self.full, got, self.targets), "kl_median": float(kl.median()),
                "kl_max": float(kl.max())}


@torch.inference_mode()
def prepare_document(lm, name: str, text: str, continuation: int = 512, context: int = 2048) -> Document:
    """Context min(``context``, n - continuation) tokens, the next ``continuation`` teacher-forced."""
    ids, _ = tokenize_document(lm.tokenizer, text)
    n_ctx = min(context, len(ids) - continuation)
    ctx, cont = ids[:n_ctx], ids[n_ctx:n_ctx + continuation]
    full = full_logits(lm, ctx, cont)
    cap = capture(lm, "", ids=ctx)
    cos, sin = rope_cos_sin(lm.model, torch.arange(n_ctx))
    return Document(lm=lm, name=name, n_ctx=n_ctx, cont=cont, targets=torch.tensor(cont[1:]), full=full, cap=cap,
                    cos=cos, sin=sin, keys_post=[apply_rope(k, cos, sin) for k in cap.keys_pre])

