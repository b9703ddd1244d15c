"""Which request-time proxy of a load's gain tracks answer quality? (YOCO's feedback signal)

    kite bench cases --n 3 --tokens 1500 --seed 23 --per-family 3 --out /tmp/gp/cases.jsonl
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gain_proxy.py --cases /tmp/gp/cases.jsonl \
        --work out/gain_proxy --threads 1

For every question of held-out generated contracts (not configs/bench_cases.jsonl) the fused
pipeline decides as `kite bench run` would (v1 rules, a fresh health store fed the gains the
pipeline measures), and besides the load it makes, forced alternatives are scored: the whole
state, the cluster of the question's label, nothing. For each load:

* candidate proxies, each computable at request time without a second generation, each
  "positive = the state told the model something", relative to the no-state forward of the
  prompt (which `kite.yoco.fused.answer` runs already):
    mean_prompt  (H̄0 − H̄1)/H̄0, mean next-token entropy over the prompt (the proxy before)
    last         (H0[-1] − H1[-1])/H0[-1], the answer's first token's distribution
    last4, last8 the same, mean over the prompt's last k positions
    gen          (H0[-1] − mean entropy over the generated tokens with the state)/H0[-1]
    prompt_nll   relative drop of the prompt tokens' own NLL (positions 1…, teacher-forced)
    last_logmaxp log max-prob at the last position, with − without (confidence gained)
    kl_last      KL(P1‖P0) at the last position (unsigned: how much the state moved it)
* ground truth: ln(PPL_none / PPL_load) of the reference answer (> 0: the load helped versus no
  document), ln(PPL_whole / PPL_load), answer F1 and its delta against no document.

Prints Spearman rank correlations and sign agreement (proxy > 0 ⇔ reference PPL below no
document's) per proxy, and what the health store would have decided fed with each proxy; rows: each
proxy's rank correlation with ln(PPL_none / PPL_load) over every load (a quality figure: no baseline,
no floor), every case under ``raw``. The states and the cases measured so far are kept in --work.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Result, clock, finish, parse, parser  # noqa: E402

PROXIES = ["mean_prompt", "last", "last4", "last8", "gen", "prompt_nll", "last_logmaxp", "kl_last"]


def _rank(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return r


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (Pearson of average ranks); nan when either side is constant."""
    if len(xs) < 3:
        return float("nan")
    rx, ry = _rank(xs), _rank(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return sxy / (sx * sy) if sx > 0 and sy > 0 else float("nan")


def _entropies(logits):
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return (-(logp.exp() * logp).sum(-1) / math.log(2)), logp


def run_variant(lm, prefix, p_ids, ref_ids, max_new):
    """Greedy answer after `prefix` (None: no document) with per-position entropies."""
    import torch

    from kite.bench.scoring import perplexity, reference_logits
    from kite.runtime.cache import new_cache
    from kite.runtime.generate import forward_tokens

    start = prefix.next_position if prefix is not None else 0
    cache = new_cache(lm.model, prefix)
    logits = forward_tokens(lm.model, p_ids, cache, start)
    h_prompt, logp_prompt = _entropies(logits)
    nll_prompt = -logp_prompt[:-1].gather(1, torch.tensor(p_ids[1:])[:, None]).squeeze(1)
    p_last = logp_prompt[-1]
    stop = lm.eos_ids()
    new, h_gen = [], []
    last = logits[-1]
    pos = start + len(p_ids)
    for _ in range(max_new):
        h, _ = _entropies(last[None])
        h_gen.append(float(h[0]))
        tok = int(torch.argmax(last))
        if tok in stop:
            break
        new.append(tok)
        if len(new) == max_new:
            break
        last = forward_tokens(lm.model, [tok], cache, pos)[-1]
        pos += 1
    text = lm.tokenizer.decode(new, skip_special_tokens=True)
    ppl = perplexity(reference_logits(lm, prefix, p_ids, ref_ids), ref_ids)
    return {"h_prompt": [float(x) for x in h_prompt], "nll_prompt": [float(x) for x in nll_prompt],
            "p_last": p_last, "h_gen": h_gen, "text": text, "ppl": ppl}


def proxies(base: dict, v: dict) -> dict[str, float]:
    def rel(a, b):
        return (a - b) / a if a > 0 else 0.0

    h0, h1 = base["h_prompt"], v["h_prompt"]
    out = {"mean_prompt": rel(sum(h0) / len(h0), sum(h1) / len(h1)), "last": rel(h0[-1], h1[-1])}
    for k in (4, 8):
        kk = min(k, len(h0))
        out[f"last{k}"] = rel(sum(h0[-kk:]) / kk, sum(h1[-kk:]) / kk)
    out["gen"] = rel(h0[-1], sum(v["h_gen"]) / len(v["h_gen"]))
    n0, n1 = base["nll_prompt"], v["nll_prompt"]
    out["prompt_nll"] = rel(sum(n0) / len(n0), sum(n1) / len(n1)) if n0 else 0.0
    out["last_logmaxp"] = float(v["p_last"].max() - base["p_last"].max())
    p1 = v["p_last"]
    out["kl_last"] = float((p1.exp() * (p1 - base["p_last"])).sum())
    return out


def main(argv=None) -> int:
    from kite.config import DEFAULT_MIN_HIT_GAIN

    ap = parser(__doc__, device="cpu")
    ap.add_argument("--cases", required=True)
    ap.add_argument("--work", default="out/gain_proxy", help="states and the cases measured so far")
    ap.add_argument("--rules", default="rules/yoco_rules.yaml")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--min-hit-gain", type=float, default=DEFAULT_MIN_HIT_GAIN)
    args = parse(ap, argv)

    import tempfile

    import torch

    torch.set_num_threads(args.threads)
    from kite.bench.cases import load_cases
    from kite.bench.runner import answer_text, check_lengths
    from kite.bench.scoring import f1_score
    from kite.bench.states import ensure_state
    from kite.upcycle import StateFile, load_prefix, open_pipeline
    from kite.yoco.fused import load_args, plan_for
    from kite.yoco.health import HealthStore
    from kite.yoco.rules import load_rules

    out_dir = Path(args.work)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = load_cases(args.cases)
    pipe = open_pipeline(None, tagger=False)
    lm = pipe.lm
    ids_of = check_lengths(lm, cases, args.max_new_tokens, True)
    pipe.load_tagger()
    tagger = pipe.tagger
    rules = load_rules(Path(args.rules), None, lm.geometry.n_layers)
    tmp = tempfile.TemporaryDirectory(prefix="kite-gain-proxy-")
    # One health store per proxy: the pipeline's decisions had each proxy been the measured gain.
    stores = {p: HealthStore(Path(tmp.name) / f"{p}.sqlite") for p in PROXIES if p != "kl_last"}
    t0 = clock()
    rows, states = [], {}
    for ci, case in enumerate(cases):
        doc_ids, p_ids, ref_ids = ids_of[case.id]
        if case.document_key not in states:
            states[case.document_key] = ensure_state(pipe, case.document_key, doc_ids, out_dir / "states")
        st = states[case.document_key]
        sid = st.path.name.removesuffix(".upc")
        base = run_variant(lm, None, p_ids, ref_ids, args.max_new_tokens)
        f1_none = f1_score(answer_text(base["text"]), case.reference)
        variants: dict[str, dict] = {}

        def variant(key: str, load_kw: dict) -> dict:
            if key not in variants:
                prefix, rep = load_prefix(st.path, lm, **load_kw)
                v = run_variant(lm, prefix, p_ids, ref_ids, args.max_new_tokens)
                v["proxies"] = proxies(base, v)
                v["labels"] = sorted(set(rep.labels))
                v["f1"] = f1_score(answer_text(v["text"]), case.reference)
                variants[key] = v
            return variants[key]

        with StateFile(st.path) as sf:
            labels = sorted({c["label"] for c in sf.meta["clusters"]})
            variant("whole", {"clusters": None, "layers": None, "precision": None})
            if case.label and case.label in labels:
                variant(f"cluster:{case.label}", {"clusters": [case.label], "layers": None, "precision": None})
            decisions = {}
            for p, store in stores.items():
                _, plan, q, _ = plan_for(lm, tagger, rules, sf, case.question, health=store,
                                         min_hit_gain=args.min_hit_gain, state_id=sid)
                if not plan.loads:
                    decisions[p] = {"variant": "none", "rule": plan.matched_rule, "reason": plan.skip_reason}
                    continue
                kw = load_args(plan, q.query_label)
                key = ("whole" if kw["clusters"] is None else "cluster:" + ",".join(kw["clusters"]))
                if kw["layers"] is not None or kw["precision"] is not None:
                    key += f"|{kw['layers']}|{kw['precision']}"
                v = variant(key, kw)
                for lab in v["labels"]:
                    store.record(sid, lab, v["proxies"][p])
                decisions[p] = {"variant": key, "rule": plan.matched_rule, "gain": v["proxies"][p]}
        whole_ppl = variants["whole"]["ppl"]
        row = {"id": case.id, "family": case.family, "label": case.label, "query_label": q.query_label,
               "label_entropy": q.label_entropy, "ppl_none": base["ppl"], "f1_none": f1_none,
               "text_none": base["text"], "decisions": decisions, "loads": {}}
        for key, v in variants.items():
            row["loads"][key] = {"ppl": v["ppl"], "f1": v["f1"], "text": v["text"], "proxies": v["proxies"],
                                 "q_vs_none": math.log(base["ppl"] / v["ppl"]),
                                 "q_vs_whole": math.log(whole_ppl / v["ppl"]),
                                 "f1_vs_none": v["f1"] - f1_none,
                                 # the load the pipeline made with the gain before the switch (mean_prompt)
                                 "fused_mean_prompt": decisions["mean_prompt"]["variant"] == key}
        rows.append(row)
        print(f"[{ci + 1}/{len(cases)} {clock() - t0:.0f}s] {case.id} {case.family} "
              f"none ppl {base['ppl']:.2f} f1 {f1_none:.2f}; " + "; ".join(
                  f"{k} ppl {v['ppl']:.2f} f1 {v['f1']:.2f} mp {v['proxies']['mean_prompt']:+.3f} "
                  f"last {v['proxies']['last']:+.3f}" for k, v in variants.items())
              + f"; fused → {decisions['mean_prompt']['variant']}", flush=True)
        (out_dir / "results.json").write_text(json.dumps({"cases": rows}, indent=1))
    for s in stores.values():
        s.close()
    tmp.cleanup()
    summary = summarize(rows)
    md = table(summary)
    print(md)
    res = Result("gain_proxy", device="cpu")
    for p, d in summary["proxies"].items():
        a = d["all"]
        if math.isnan(a["rho_ppl_vs_none"]):     # a constant proxy: no rank correlation
            continue
        res.row(f"{p}: Spearman rho with ln(PPL_none / PPL_load), all loads", a["rho_ppl_vs_none"], "rho",
                sign_agree=a["sign_agree"], rho_f1_vs_none=a["rho_f1_vs_none"], loads=a["n"],
                pairwise_order=d["pairwise_order"], pipeline=d.get("pipeline"))
    res.raw.update(cases=rows, summary=summary, threads=args.threads, wall_s=round(clock() - t0, 1))
    return finish(res, args)


def summarize(rows: list[dict]) -> dict:
    loads = [(r, k, v) for r in rows for k, v in r["loads"].items()]
    out = {"n_questions": len(rows), "n_loads": len(loads), "proxies": {}}
    subsets = {"all": loads, "one_cluster": [x for x in loads if x[1].startswith("cluster:")],
               "whole": [x for x in loads if x[1] == "whole"]}
    for p in PROXIES:
        d = {}
        for name, sub in subsets.items():
            xs = [v["proxies"][p] for _, _, v in sub]
            d[name] = {
                "n": len(sub),
                "rho_ppl_vs_none": spearman(xs, [v["q_vs_none"] for _, _, v in sub]),
                "rho_f1_vs_none": spearman(xs, [v["f1_vs_none"] for _, _, v in sub]),
                "rho_f1": spearman(xs, [v["f1"] for _, _, v in sub]),
                "sign_agree": sum((x > 0) == (v["q_vs_none"] > 0) for x, (_, _, v) in zip(xs, sub)) / max(1, len(sub)),
                "false_negatives": sum(x <= 0 and v["q_vs_none"] > 0 for x, (_, _, v) in zip(xs, sub)),
                "positive": sum(x > 0 for x in xs),
            }
        # Within a question: does the proxy order whole vs one cluster as the reference PPL does?
        pairs = agree = 0
        for r in rows:
            ks = list(r["loads"])
            for i in range(len(ks)):
                for j in range(i + 1, len(ks)):
                    a, b = r["loads"][ks[i]], r["loads"][ks[j]]
                    dq = a["q_vs_none"] - b["q_vs_none"]
                    dp = a["proxies"][p] - b["proxies"][p]
                    if dq != 0:
                        pairs += 1
                        agree += (dq > 0) == (dp > 0)
        d["pairwise_order"] = agree / pairs if pairs else float("nan")
        d["pairs"] = pairs
        if p != "kl_last":
            dec = [r["decisions"][p] for r in rows]
            d["pipeline"] = {"skipped": sum(x["variant"] == "none" for x in dec),
                             "skipped_but_load_helped": sum(
                                 x["variant"] == "none" and any(v["q_vs_none"] > 0 for v in r["loads"].values())
                                 for x, r in zip(dec, rows))}
        out["proxies"][p] = d
    out["helped_vs_none"] = sum(v["q_vs_none"] > 0 for _, _, v in loads)
    return out


def table(s: dict) -> str:
    lines = [f"{s['n_questions']} questions, {s['n_loads']} loads ({s['helped_vs_none']} lowered the reference "
             "PPL below no document's)", "",
             "| proxy | ρ(proxy, ln PPL_none/PPL) all | one-cluster | whole | ρ(proxy, ΔF1 vs none) all "
             "| sign agree all (one-cluster) | proxy ≤ 0 but helped | pairwise order | pipeline skips (of which a load helped) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p, d in s["proxies"].items():
        a, o, w = d["all"], d["one_cluster"], d["whole"]
        pipe = d.get("pipeline")
        lines.append(
            f"| {p} | {a['rho_ppl_vs_none']:+.3f} | {o['rho_ppl_vs_none']:+.3f} | {w['rho_ppl_vs_none']:+.3f} "
            f"| {a['rho_f1_vs_none']:+.3f} | {a['sign_agree']:.3f} ({o['sign_agree']:.3f}) "
            f"| {a['false_negatives']} of {a['n']} | {d['pairwise_order']:.3f} ({d['pairs']}) "
            f"| {'—' if pipe is None else str(pipe['skipped']) + ' (' + str(pipe['skipped_but_load_helped']) + ')'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
