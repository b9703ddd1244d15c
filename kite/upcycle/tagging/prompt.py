"""Few-shot prompt scoring of clause types, calibrated against a content-free input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kite.runtime.generate import cache_kwarg


class PromptScorer:
    """Few-shot prompt scoring with contextual calibration (Zhao et al., 2021).

    score(text)[label] = log p(label name | shots + text) − log p(label name | shots + "N/A").
    Shots: one example per label (its shortest), in sorted label order.
    """

    TEMPLATE = "Clause: {text}\nType:"
    HEADER = "Classify each contract clause by its type ({names}).\n\n"

    def __init__(self, model, tokenizer, labels, label_names=None):
        self.model, self.tok, self.labels = model, tokenizer, labels
        self.names = {lab: (label_names or {}).get(lab, lab.replace("_", " ")) for lab in labels}
        self.shots: list[tuple[str, str]] = []
        self.content_free: torch.Tensor | None = None

    def set_shots(self, data: Sequence[tuple[str, str]]) -> None:
        self.shots = []
        for lab in self.labels:
            texts = sorted((t for t, lb in data if lb == lab), key=lambda t: (len(t), t))
            if texts:
                self.shots.append((_clip_words(texts[0], 60), lab))
        self.content_free = self._raw(["N/A"])[0]

    def _prefix(self) -> str:
        head = self.HEADER.format(names=", ".join(self.names[lab] for lab in self.labels))
        return head + "".join(self.TEMPLATE.format(text=t) + f" {self.names[lab]}\n\n"
                              for t, lab in self.shots)

    @torch.no_grad()
    def _raw(self, texts: list[str]) -> torch.Tensor:
        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        cands = [self.tok(" " + self.names[lab], add_special_tokens=False)["input_ids"]
                 for lab in self.labels]
        out = torch.zeros(len(texts), len(self.labels))
        for i, text in enumerate(texts):
            prompt = self._prefix() + self.TEMPLATE.format(text=_clip_words(text, 200))
            ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([ids], device=device)
            cache = DynamicCache(config=self.model.config)
            kw = cache_kwarg(self.model)   # `cache` in transformers 5.2x, `past_key_values` before
            res = self.model(input_ids=ids, use_cache=True, **{kw: cache})
            first = torch.log_softmax(res.logits[0, -1].float(), -1)
            n = ids.shape[1]
            for j, cand in enumerate(cands):
                lp = first[cand[0]].item()
                if len(cand) > 1:
                    r = self.model(input_ids=torch.tensor([cand[:-1]], device=device),
                                   use_cache=True, **{kw: cache})
                    logp = torch.log_softmax(r.logits[0].float(), -1)
                    lp += sum(logp[t, cand[t + 1]].item() for t in range(len(cand) - 1))
                    _crop_to(cache, n)
                out[i, j] = lp
        return out

    def score(self, texts: list[str]) -> torch.Tensor:
        return self._raw(texts) - self.content_free

    def to_dict(self) -> dict[str, Any]:
        return {"shots": [list(s) for s in self.shots], "names": self.names,
                "content_free": self.content_free.tolist()}

    @classmethod
    def from_dict(cls, model, tokenizer, labels, d) -> PromptScorer:
        p = cls(model, tokenizer, labels, d["names"])
        p.shots = [(t, lab) for t, lab in d["shots"]]
        p.content_free = torch.tensor(d["content_free"])
        return p


def _crop_to(cache, n: int) -> None:
    """Cut the cache back to its first `n` tokens (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)
    if cache.get_seq_length() != n:
        raise RuntimeError(f"could not crop the KV cache back to {n} tokens")


def _clip_words(text: str, n: int) -> str:
    words = text.split()
    return text if len(words) <= n else " ".join(words[:n]) + " …"
