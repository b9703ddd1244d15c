"""Query signals that need the model: intent entropy (bits) and the query's clause label.

One batched forward per group of queries gives both: next-token entropies from the logits and,
from the same pass's hidden states, the tagger's embedding of the query (at its query head's
layer when it has one: `ClauseTagger.query_layers` / `predict_queries`, calibrated on questions).

The pass is built for traffic samples (`kite yoco analyze`): queries are tokenized in one call,
sorted by token count and cut into batches under a padded-token budget (little padding), the
decoder runs without a KV cache, and the LM head runs only on the queries' real tokens, a chunk
at a time, with the entropy taken as logsumexp(z) − Σ softmax(z)·z (no [B, T, V] probability
tensor). Precisions other than fp32 are opt-in; their measured deviation is in
docs/rules-dsl.md ("Analyzing traffic").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from kite.runtime.batch import right_padded
from kite.runtime.kernel_pass import hidden_pass, warm as warm_pass
from kite.runtime.lowp import bf16_linears

if TYPE_CHECKING:
    from kite.model import LoadedModel
PRECISIONS = ("fp32", "bf16")
_LN2 = math.log(2.0)


@dataclass
class QuerySignals:
    intent_entropy: float  # bits: mean next-token entropy over the query's tokens
    query_label: str  # "": no tagger, or the query head says it names no clause type
    label_entropy: float  # bits: entropy of the tagger's label distribution
    label_probs: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    # The same pass's teacher-forced NLL (bits, mean over the tokens after the first) of these token
    # ids: what the measured gain's side without a state needs (kite.yoco.fused.prompt_nll), so a
    # prompt that is the query costs no second forward. None: fewer than 2 tokens.
    ids: tuple[int, ...] = ()
    nll_bits: float | None = None


def _entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * torch.log2(probs.clamp_min(1e-12))).sum(-1)


def entropy_bits_of_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (bits) of softmax(logits) over the last axis: (logsumexp(z) − Σ p·z) / ln 2."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    return (lse.squeeze(-1) - (p * z).sum(-1)) / _LN2


def nll_bits_of_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (bits) of `targets` [N] under softmax(logits [N, V]); NaN where a
    target is negative (no next token)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    got = -logp.gather(1, targets.clamp_min(0).to(logp.device)[:, None]).squeeze(1) / _LN2
    return torch.where(targets.to(got.device) >= 0, got, torch.full_like(got, math.nan))


def head_entropy_bits(head: torch.nn.Module, hidden: torch.Tensor, chunk: int | None = None,
                      targets: torch.Tensor | None = None):
    """Entropy (bits) of the next-token distribution for each row of `hidden` [N, D], running
    `head` (the LM head) `chunk` rows at a time (default: 64 on a CPU, so the logits stay small
    enough for the cache; 512 on a GPU, a few hundred MB of logits); the results cross to the host
    once. With `targets` [N] (each row's next token id, −1 for none): (entropies, NLL bits of the targets)."""
    if chunk is None:
        chunk = 512 if hidden.is_cuda else 64
    ents, nlls = [], []
    for s in range(0, hidden.shape[0], chunk):
        logits = head(hidden[s:s + chunk])
        ents.append(entropy_bits_of_logits(logits).float())
        if targets is not None:
            nlls.append(nll_bits_of_logits(logits, targets[s:s + chunk]).float())

    if not ents:
        return torch.empty(0) if targets is None else (torch.empty(0), torch.empty(0))
    if targets is None:
        return torch.cat(ents).cpu()
    both = torch.cat(ents + nlls).cpu()      # one transfer (one wait for the device), then split
    return both[:both.shape[0] // 2], both[both.shape[0] // 2:]


def _flat_rows(hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Rows ``real`` (flat indices over [B, T]) of ``hidden`` [B, T, D]: [N, D]."""
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, real)


def _next_tokens(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each real position's next token id in its row, −1 at a row's last token (right-padded rows)."""
    nxt = torch.full_like(ids, -1)
    nxt[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], torch.full_like(ids[:, 1:], -1))
    return nxt


def _plain_head(model) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, LM head) when logits are exactly head(decoder(x)) — the Llama family; else None
    (logit soft-capping or scaling: run the whole model instead)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return None
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return (decoder, head) if decoder is not None and head is not None else None


def _batches(lengths: list[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length, cut so each batch has ≤ batch_size rows and ≤ batch_tokens
    padded tokens (rows × longest row)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1 > batch_size or (len(cur) + 1) * lengths[i] > batch_tokens):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


@torch.inference_mode()
def query_signals(lm: LoadedModel, queries: list[str], tagger=None, batch_size: int | None = None,
                  max_tokens: int = 128, *, batch_tokens: int | None = None, precision: str = "fp32",
                  progress: Callable[[int, int], None] | None = None) -> list[QuerySignals]:
    """Signals for each query, in order (right-padded batches, so each query's own tokens are
    unaffected by the others; by default at most 64 rows and 1,024 padded tokens a batch on a CPU,
    256 and 8,192 on a GPU, where a server's burst of questions is one pass, not several). `precision`: fp32 (exact) or bf16 (the matmuls on bf16 weights, fp32
    between them: faster on AVX512-BF16 CPUs, entropies off by a little; measured by
    benchmarks/yoco_analyze.py, docs/rules-dsl.md). Repeated texts are computed once.
    `progress(done, total)` after each batch, in distinct texts."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    gpu = torch.device(lm.device).type == "cuda"
    batch_size = batch_size or (256 if gpu else 64)
    batch_tokens = batch_tokens or (8192 if gpu else 1024)
    # Each distinct text runs once (traffic repeats itself: "hi", the same question twice).
    slot: dict[str, int] = {}
    which = [slot.setdefault(q, len(slot)) for q in queries]
    distinct = _distinct_signals(lm, list(slot), tagger, batch_size, max_tokens, batch_tokens, precision,
                                 progress)
    return [replace(distinct[k], label_probs=dict(distinct[k].label_probs)) for k in which]


def warm_query_signals(lm: LoadedModel, tagger=None) -> int:
    """On a GPU with the fused layers: capture the pass :func:`query_signals` makes for every bucket of
    a few short queries now (kite.runtime.kernel_pass.warm), keeping the layers ``tagger`` reads, so a
    server's first bursts replay it; how many graphs that is (0 elsewhere)."""
    if _plain_head(lm.model) is None:
        return 0
    return warm_pass(lm.model, tuple(tagger.query_layers) if tagger is not None else ())


def _distinct_signals(lm: LoadedModel, queries: list[str], tagger, batch_size: int, max_tokens: int, batch_tokens: int,
                      precision: str, progress) -> list[QuerySignals]:
    tok = lm.tokenizer
    layers = list(tagger.query_layers) if tagger is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    enc = tok(list(queries), add_special_tokens=False)["input_ids"] if queries else []
    enc = [e[:max_tokens] or [pad] for e in enc]
    results: list[QuerySignals | None] = [None] * len(enc)
    done = 0
    # bf16: the Linear layers on bf16 weights cast once, fp32 between them (kite.runtime.lowp)
    with bf16_linears(lm.model) if precision == "bf16" else nullcontext():
        plain = _plain_head(lm.model)
        device = lm.device
        for idx in _batches([len(e) for e in enc], batch_size, batch_tokens):
            ids, mask = right_padded([enc[i] for i in idx], pad)
            m = mask.bool()
            # the real positions, flat, picked by index on the device (a boolean mask there would
            # wait for the device to count them), and their next tokens: on the device before the pass
            real = m.flatten().nonzero().squeeze(1).to(device, non_blocking=True)
            targets = _next_tokens(ids, mask)[m].to(device, non_blocking=True)
            passed = hidden_pass(lm.model, ids, tuple(layers)) if plain is not None else None
            if passed is not None:       # a GPU with the fused layers: the pass on KITE's kernels
                last, hidden_states = passed
                ent_flat, nll_flat = head_entropy_bits(plain[1], _flat_rows(last, real), targets=targets)
            elif plain is not None:
                decoder, head = plain
                res = decoder(input_ids=ids.to(device), attention_mask=mask.to(device),
                              output_hidden_states=bool(layers), use_cache=False)
                ent_flat, nll_flat = head_entropy_bits(head, _flat_rows(res.last_hidden_state, real), targets=targets)
                hidden_states = res.hidden_states
            else:
                res = lm.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                               output_hidden_states=bool(layers), use_cache=False)
                logits = res.logits[m.to(device)]
                ent_flat = entropy_bits_of_logits(logits).cpu()
                nll_flat = nll_bits_of_logits(logits, targets).cpu()
                hidden_states = res.hidden_states
            # Mean over each row's own tokens: the flat entropies are in row-major order.
            counts = m.sum(1)
            row_of = torch.repeat_interleave(torch.arange(len(idx)), counts)
            sums = torch.zeros(len(idx)).index_add_(0, row_of, ent_flat)
            means = (sums / counts.clamp_min(1)).tolist()
            known = ~torch.isnan(nll_flat)
            nll_sums = torch.zeros(len(idx)).index_add_(0, row_of[known], nll_flat[known])
            nll_counts = torch.zeros(len(idx)).index_add_(0, row_of[known], torch.ones(int(known.sum())))
            tags = None
            if layers:     # each row's mean over its own tokens at the tagger's layers, scored where they are
                mf = mask[..., None].to(hidden_states[layers[0]].device, torch.float32)
                emb = torch.cat([(hidden_states[h].float() * mf).sum(1) / mf.sum(1) for h in layers], dim=-1)
                tags = tagger.predict_queries(emb)
            for row, i in enumerate(idx):
                probs = tags[row].probs if tags else {}
                results[i] = QuerySignals(
                    intent_entropy=float(means[row]), query_label=tags[row].label if tags else "",
                    label_entropy=_label_entropy(probs), label_probs=probs, tokens=int(counts[row]),
                    ids=tuple(enc[i]),
                    nll_bits=float(nll_sums[row] / nll_counts[row]) if nll_counts[row] else None)
            done += len(idx)
            if progress is not None:
                progress(done, len(enc))
    out = [r for r in results if r is not None]
    if tagger is not None and not layers and queries:  # a prompt-scoring tagger reads the text
        for sig, tag in zip(out, tagger.tag_queries(lm.model, tok, queries)):
            sig.query_label, sig.label_probs = tag.label, tag.probs
            sig.label_entropy = _label_entropy(tag.probs)
    return out


def _label_entropy(probs: dict[str, float]) -> float:
    return max(0.0, float(-sum(p * math.log2(p) for p in probs.values() if p > 0)))  # no -0.0
