"""Answer quality: SQuAD-style exact match and token F1, and the reference's teacher-forced PPL."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kite.data.answers import exact_match, f1_score, normalize_answer

if TYPE_CHECKING:
    from kite.model import LoadedModel

__all__ = ["exact_match", "f1_score", "normalize_answer", "perplexity", "reference_logits"]


@torch.inference_mode()
def reference_logits(lm: LoadedModel, prefix, prompt_ids: list[int], reference_ids: list[int]) -> torch.Tensor:
    """Logits [len(reference), vocab] predicting each reference token after prefix + prompt."""
    from kite.runtime.cache import new_cache
    from kite.runtime.generate import forward_tokens

    start = prefix.next_position if prefix is not None else 0
    ids = prompt_ids + reference_ids[:-1]
    logits = forward_tokens(lm.model, ids, new_cache(lm.model, prefix), start)
    return logits[len(prompt_ids) - 1:]


def perplexity(logits: torch.Tensor, targets: list[int]) -> float:
    """exp(mean NLL) of `targets` under `logits` [n, vocab]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, torch.tensor(targets, device=logp.device)[:, None]).squeeze(1)
    value = float(torch.exp(nll.mean()))
    return value if math.isfinite(value) else float("inf")
