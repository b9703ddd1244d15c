"""Query signals that need the model: intent entropy (bits) and the query's clause label.

One batched forward per group of queries gives both: next-token entropies from the logits and,
from the same pass's hidden states, the tagger's embedding of the query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class QuerySignals:
    intent_entropy: float  # bits: mean next-token entropy over the query's tokens
    query_label: str  # "" when there is no tagger
    label_entropy: float  # bits: entropy of the tagger's label distribution
    label_probs: dict[str, float] = field(default_factory=dict)
    tokens: int = 0


def _entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * torch.log2(probs.clamp_min(1e-12))).sum(-1)


@torch.inference_mode()
def query_signals(lm, queries: list[str], tagger=None, batch_size: int = 32,
                  max_tokens: int = 128) -> list[QuerySignals]:
    """Signals for each query (right-padded batches, so each query's own tokens are unaffected)."""
    tok = lm.tokenizer
    layers = list(tagger.embedding_layers) if tagger is not None and tagger.embedding_layers else []
    out: list[QuerySignals] = []
    order = sorted(range(len(queries)), key=lambda i: len(queries[i]))  # similar lengths together
    results: dict[int, QuerySignals] = {}
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        enc = [tok(queries[i], add_special_tokens=False)["input_ids"][:max_tokens] or [pad] for i in idx]
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), pad, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for row, e in enumerate(enc):
            ids[row, :len(e)] = torch.tensor(e)
            mask[row, :len(e)] = 1
        res = lm.model(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device),
                       output_hidden_states=bool(layers))
        ent = _entropy_bits(torch.softmax(res.logits.float(), dim=-1)).cpu()
        m = mask.bool()
        emb = None
        if layers:
            emb = torch.cat([(res.hidden_states[h].float().cpu() * mask[..., None]).sum(1)
                             / mask.sum(1, keepdim=True) for h in layers], dim=-1)
        tags = tagger.predict_embeddings(emb) if emb is not None else None
        for row, i in enumerate(idx):
            n = int(m[row].sum())
            probs = tags[row].probs if tags else {}
            results[i] = QuerySignals(
                intent_entropy=float(ent[row][m[row]].mean()) if n else 0.0,
                query_label=tags[row].label if tags else "",
                label_entropy=float(-sum(p * math.log2(p) for p in probs.values() if p > 0)),
                label_probs=probs, tokens=n)
    out = [results[i] for i in range(len(queries))]
    if tagger is not None and not layers and queries:  # a prompt-scoring tagger reads the text
        for sig, tag in zip(out, tagger.tag_texts(lm.model, tok, queries)):
            sig.query_label, sig.label_probs = tag.label, tag.probs
            sig.label_entropy = float(-sum(p * math.log2(p) for p in tag.probs.values() if p > 0))
    return out
