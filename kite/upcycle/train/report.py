"""What a trained run is worth on documents it never saw: for each held-out pair and training ratio,
the PPL of the reference response after the full context, after the state without the adapter and
after the state with it, and the greedy answers' F1 against the reference with and without the
adapter (loss can fall while generation collapses: the report shows both)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kite.data.answers import f1_score
from kite.errors import BadInput
from kite.runtime.batch_decode import BatchDecoder
from kite.runtime.cache import KVPrefix, new_cache
from kite.runtime.generate import forward_tokens, generate
from kite.upcycle.train.adapter import Example, student_batch_logits, tokenize_pair
from kite.upcycle.train.data import Pair

if TYPE_CHECKING:
    from kite.model import LoadedModel


@torch.inference_mode()
def _nll(model, cache, start: int, ex: Example) -> float:
    """Mean NLL (nats) of the response tokens after ``cache`` (a state, or the full context, whose
    last position is ``start`` - 1)."""
    logits = forward_tokens(model, ex.prompt_ids + ex.response_ids[:-1], cache, start)[len(ex.prompt_ids) - 1:]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-logp.gather(1, torch.tensor(ex.response_ids, device=logp.device)[:, None]).mean())


@torch.inference_mode()
def _full_context_nll(model, pairs: list[Pair], examples: list[Example], tokenizer) -> list[float]:
    """Each pair's response NLL after its full context: the teacher's when it kept it, else each
    document prefilled once."""
    if all(ex.full_logp is not None for ex in examples):
        return [float(-ex.full_logp.mean()) for ex in examples]
    out: list[float] = [0.0] * len(pairs)
    by_doc: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        by_doc.setdefault(ex.doc, []).append(i)
    for idx in by_doc.values():
        ctx, _, _ = tokenize_pair(tokenizer, pairs[idx[0]])
        cache = new_cache(model)
        forward_tokens(model, ctx, cache, 0)
        for i in idx:
            out[i] = _nll(model, cache, len(ctx), examples[i])
            cache.crop(-(len(examples[i].prompt_ids) + len(examples[i].response_ids) - 1))
    return out


NLL_ROWS = 8      # held-out pairs scored in one forward, each after its own state


@torch.inference_mode()
def _state_nll(model, prefixes: list[KVPrefix], examples: list[Example]) -> list[float]:
    """Each example's mean response NLL after its state, the rows in one padded forward
    (:func:`kite.upcycle.train.adapter.student_batch_logits`; a state loaded in part, one at a time)."""
    if len(examples) > 1 and all(len(set(p.tokens_per_layer())) == 1 for p in prefixes):
        rows = student_batch_logits(model, prefixes, examples)
    else:
        rows = [forward_tokens(model, ex.prompt_ids + ex.response_ids[:-1], new_cache(model, p),
                               p.next_position)[len(ex.prompt_ids) - 1:] for p, ex in zip(prefixes, examples)]
    out = []
    for logits, ex in zip(rows, examples):
        logp = torch.log_softmax(logits.float(), dim=-1)
        out.append(float(-logp.gather(1, torch.tensor(ex.response_ids, device=logp.device)[:, None]).mean()))
    return out


def held_out_report(lm: LoadedModel, peft_model, pairs: list[Pair], examples: list[Example],
                    prefixes: dict[float, Callable[[str], KVPrefix]], progress=None) -> dict:
    """Per training ratio: mean PPL (full / state / state + adapter), the share of the gap between
    the state and full context the adapter recovers, and mean answer F1 without / with it."""
    out = {}
    total = len(prefixes) * len(examples)
    done = 0
    with peft_model.disable_adapter():
        full = _full_context_nll(lm.model, pairs, examples, lm.tokenizer)
    for ratio, prefix_of in prefixes.items():
        nll = {"full": list(full), "state": [], "state_adapter": []}
        states = [prefix_of(ex.doc) for ex in examples]
        for at in range(0, len(examples), NLL_ROWS):
            rows, exs = states[at:at + NLL_ROWS], examples[at:at + NLL_ROWS]
            with peft_model.disable_adapter():
                nll["state"] += _state_nll(lm.model, rows, exs)
            nll["state_adapter"] += _state_nll(lm.model, rows, exs)
            done += len(exs)
            if progress:
                progress("held-out report", done, total)
        with peft_model.disable_adapter():
            plain = greedy_answers(lm, states, examples)
        adapted = greedy_answers(lm, states, examples)
        f1 = {"state": [f1_score(a, p.response) for a, p in zip(plain, pairs)],
              "state_adapter": [f1_score(a, p.response) for a, p in zip(adapted, pairs)]}
        ppl = {k: math.exp(sum(v) / len(v)) for k, v in nll.items()} if examples else {}
        gap = ppl.get("state", 0) - ppl.get("full", 0)
        out[f"{ratio:g}"] = {
            "pairs": len(examples),
            "ppl_full": round(ppl["full"], 4) if ppl else None,
            "ppl_state": round(ppl["state"], 4) if ppl else None,
            "ppl_state_adapter": round(ppl["state_adapter"], 4) if ppl else None,
            "gap_recovered": round((ppl["state"] - ppl["state_adapter"]) / gap, 4) if ppl and gap > 0 else None,
            "f1_state": round(sum(f1["state"]) / len(f1["state"]), 4) if examples else None,
            "f1_state_adapter": round(sum(f1["state_adapter"]) / len(f1["state_adapter"]), 4) if examples else None,
        }
        out[f"{ratio:g}"]["adapter_helps"] = adapter_helps(out[f"{ratio:g}"])
    return out


def adapter_helps(held: dict) -> bool | None:
    """Whether the adapter reads the held-out states of a ratio better than none: it recovers part of
    the PPL gap and the greedy answers' F1 is no worse (None when the split measured neither).
    On SmolLM2 adapters have lowered PPL while answers got worse, and at 8x read documents unlike
    their training data worse than none (docs/PERFORMANCE.md, "Training"): a state made for the
    adapter switches it on, so a ratio where it hurts is better served without it."""
    gap, f1_off, f1_on = held.get("gap_recovered"), held.get("f1_state"), held.get("f1_state_adapter")
    if gap is None or f1_off is None or f1_on is None:
        return None
    return gap > 0 and f1_on >= f1_off


ANSWER_ROWS = 8     # greedy answers decoded together (kite.runtime.batch_decode: each row after its own state)


def greedy_answers(lm: LoadedModel, prefixes: list[KVPrefix], examples: list[Example], rows: int = ANSWER_ROWS) -> list[str]:
    """Each example's greedy answer after its state (the reference's length + 8 tokens), decoded
    ``rows`` at a time in one batch: the same tokens as one at a time (kite.runtime.generate), far
    fewer forwards. A row the batch refuses (past a model's sliding window) is decoded alone."""
    decoder = BatchDecoder(lm, max_rows=rows)
    todo = list(range(len(examples)))
    owner: dict[int, int] = {}
    texts: dict[int, str] = {}
    while todo or len(decoder):
        while todo and len(decoder) < rows:
            i = todo.pop(0)
            ex, new = examples[i], len(examples[i].response_ids) + 8
            try:
                owner[decoder.add(ex.prompt_ids, prefix=prefixes[i], max_new_tokens=new)] = i
            except BadInput:
                texts[i] = generate(lm, ex.prompt_ids, max_new_tokens=new, prefix=prefixes[i]).text
        for handle, result in decoder.step().items():
            texts[owner[handle]] = result.text
    return [texts[i] for i in range(len(examples))]


def loss_plot(histories: dict[str, dict], path: Path) -> Path | None:
    """A PNG of each history's loss per step (and its running mean over 20), one colour per label
    (a run's training ratios); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import io

    from kite.atomic import write_bytes

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    for label, history in histories.items():
        loss = history.get("loss") or []
        line, = ax.plot(range(1, len(loss) + 1), loss, lw=0.8, alpha=0.4, label=f"{label} loss per step")
        if len(loss) >= 20:
            run = [sum(loss[max(0, i - 19):i + 1]) / len(loss[max(0, i - 19):i + 1]) for i in range(len(loss))]
            ax.plot(range(1, len(loss) + 1), run, lw=1.6, color=line.get_color(), label=f"{label} mean of the last 20")
    ax.set_xlabel("step")
    ax.set_ylabel("KL (teacher ‖ student)")
    ax.set_title("kite upcycle train: reader adapter")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_bytes(path, buf.getvalue())
    return path
