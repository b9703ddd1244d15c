"""Training pairs from generated contracts (`kite data pairs`): {context, prompt, response} per
question, in the completion style the embedded model answers best (the prompt continues the
document; the response is the fact)."""

from __future__ import annotations

from collections.abc import Callable

from kite.data.contracts import generate_contracts

# Families whose answers are one fact a state must carry (summaries are long and judged loosely).
FAMILIES = ("qa", "needle", "fuzzy", "multihop")


def contract_pairs(n: int, tokens: int = 2000, seed: int = 0,
                   count_tokens: Callable[[str], int] | None = None) -> list[dict]:
    """The pairs of ``n`` generated contracts (one per question of the families above)."""
    out, seen = [], set()
    for rec in generate_contracts(n, tokens, seed, count_tokens):
        for q in rec["questions"]:
            if q["family"] not in FAMILIES or not q.get("prompt") or not q.get("answer"):
                continue
            if (rec["id"], q["prompt"], q["answer"]) in seen:   # a fuzzy question asks what a qa one does
                continue
            seen.add((rec["id"], q["prompt"], q["answer"]))
            out.append({"id": f"{rec['id']}/{q['id']}", "context": rec["text"], "prompt": "\n" + q["prompt"],
                        "response": " " + q["answer"], "meta": {"family": q["family"], "label": q["label"]}})
    return out
