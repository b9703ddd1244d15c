"""`run_bench`: the same cases, in one process, through every method; results written after
every case (atomically) so an interrupted or failing run keeps what it finished."""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kite.bench.cases import BenchCase, load_cases
from kite.bench.document import DocumentContext
from kite.bench.methods import ALL_METHODS, BASELINES, Fused, Method, kvpress_status
from kite.bench.reuse import BenchReuse, Reference
from kite.config import DEFAULT_MIN_HIT_GAIN
from kite.data.answers import answer_text
from kite.errors import BadInput

if TYPE_CHECKING:
    from kite.model import LoadedModel

Progress = Callable[[str, int, int], None]


@dataclass
class BenchSettings:
    cases: str
    output: str
    model: str | None = None
    upcycle_dir: str = "bench-states"
    rules: str | None = None
    upcycle_config: str | None = None
    baselines: list[str] = field(default_factory=lambda: ["full", "window", "kivi", "snapkv", "state", "kvpress"])
    thresholds: str | None = None
    families: list[str] | None = None
    per_family: int | None = None
    max_cases: int | None = None
    max_new_tokens: int = 32
    ratio: float | None = None  # state compression ratio; None: kept_fraction's, else the upcycle config's
    kept_fraction: float | None = None  # the KITE config's features.upcycle_compression_ratio (0-1)
    min_hit_gain: float = DEFAULT_MIN_HIT_GAIN  # the KITE config's features.yoco_min_hit_gain
    chat: bool = True
    device: str | None = None
    # The health store the fused pipeline records its measured gains in. None: a fresh store for
    # this run (results do not depend on earlier runs); a path: that store (e.g. the shared
    # $KITE_HOME/health.sqlite, to measure the pipeline as it has learned so far).
    health_store: str | None = None
    # The memory-budgeted method (`budget`: kite generate/serve --kv-budget-tokens) at this many raw
    # tokens; given, `budget` is run; None: 1024 when `budget` is among the baselines.
    kv_budget_tokens: int | None = None
    # `--concurrency N`: also serve the cases' answers from their states to N clients at once, batched
    # and one at a time (kite.bench.concurrency); None: not measured.
    concurrency: int | None = None


def check_methods(names: list[str]) -> list[str]:
    bad = [n for n in names if n not in BASELINES]
    if bad:
        raise BadInput(f"--baselines {bad[0]!r}: expected some of {', '.join(BASELINES)}")
    if "full" not in names:
        names = ["full", *names]  # the reference every delta is measured against
    return list(dict.fromkeys(names))


def prompt_text(case: BenchCase) -> tuple[str, bool]:
    """(text the model continues after the document, whether it goes through the chat template).

    A case with a completion-style `prompt` is asked as `\nP`: of the formats measured, the one
    with the best full-prefill F1 (docs/bench-cases.md, "Prompt format"); a case without one
    asks its question through the chat template. YOCO's signals read the question either way."""
    if case.prompt is None:
        return case.question, True
    return f"\n{case.prompt}", False


def prompt_ids(lm: LoadedModel, case: BenchCase, chat: bool = True) -> list[int]:
    """The case's prompt after the document (no BOS: it continues the document). `chat=False`
    asks a case without a `prompt` as `\nQuestion: Q\nAnswer:` instead of a chat turn."""
    from kite.runtime.generate import encode_prompt

    text, wants_chat = prompt_text(case)
    use_chat = wants_chat and chat and bool(getattr(lm.tokenizer, "chat_template", None))
    if wants_chat and not use_chat:
        text = f"\nQuestion: {case.question}\nAnswer:"
    return encode_prompt(lm.tokenizer, text, chat=use_chat, add_special_tokens=False)


def check_lengths(lm: LoadedModel, cases: list[BenchCase], max_new_tokens: int, chat: bool) -> dict[str, tuple]:
    """Token ids of every case; a case past the model's context is BadInput (file:line)."""
    from kite.bench.document import document_ids

    limit = lm.geometry.context_length
    docs: dict[str, list[int]] = {}
    out = {}
    for c in cases:
        ids = docs.setdefault(c.document_key, document_ids(lm, c.document))
        p = prompt_ids(lm, c, chat)
        ref = lm.tokenizer(" " + c.reference.strip(), add_special_tokens=False)["input_ids"]
        need = len(ids) + len(p) + max(len(ref), max_new_tokens)
        if limit and need > limit:
            raise BadInput(f"{c.where}: case {c.id}: document ({len(ids)}) + prompt ({len(p)}) + "
                           f"reference ({len(ref)}) or --max-new-tokens ({max_new_tokens}) tokens = "
                           f"{need}, past the model's context of {limit}")
        out[c.id] = (ids, p, ref)
    return out


def write_result(path: str | Path, result: dict) -> None:
    from kite.atomic import write_text

    write_text(path, json.dumps(result, indent=1, default=_json_default) + "\n")


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def _tagger_key(fingerprint: str, cfg, cfg_path) -> str:
    """What the tagger depends on: the model and the config's tagging section (its examples file
    by absolute path: a config written elsewhere with the same examples gets the same tagger)."""
    tagging = cfg.semantic_tagging.model_dump(mode="json")
    tagging["examples_file"] = str(cfg.resolve(tagging["examples_file"], cfg_path) or "")
    return json.dumps([fingerprint, tagging], sort_keys=True)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _concurrency(s: BenchSettings, pipe, cases: list[BenchCase], ids_of: dict, progress) -> dict:
    """Every case's question after its document's whole state, to ``s.concurrency`` clients."""
    from kite.bench.concurrency import measure
    from kite.bench.states import ensure_state
    from kite.upcycle import load_prefix

    prefixes: dict = {}
    requests = []
    for c in cases:
        doc_ids, p_ids, _ = ids_of[c.id]
        if c.document_key not in prefixes:
            ref = ensure_state(pipe, c.document_key, doc_ids, Path(s.upcycle_dir), progress)
            prefixes[c.document_key] = load_prefix(ref.path, pipe.lm)[0]
        requests.append((p_ids, prefixes[c.document_key]))
    if progress:
        progress("concurrency", 0, 1)
    out = measure(pipe.lm, requests, s.concurrency, s.max_new_tokens)
    if progress:
        progress("concurrency", 1, 1)
    return out


def run_bench(s: BenchSettings, progress: Progress | None = None,
              record: Callable[[dict], None] | None = None, reuse: BenchReuse | None = None) -> dict:
    """Run the benchmark; returns the result document (also written to `s.output`).

    Once the cases start, the run ends in exactly one result document, however it ends: complete,
    a case failing (its exception re-raised) or Ctrl-C (`interrupted`, KeyboardInterrupt
    re-raised); `record` (e.g. the history's append) is called once with it.

    `reuse` (kite tune's points): the model, the tagger and full prefill's answers kept from
    earlier runs given the same object are read instead of made again, and this run's are kept;
    the result's `reuse` says what was read and the time it had cost."""
    import torch

    from kite.bench import report
    from kite.bench.document import prefill_document
    from kite.bench.machine import machine_info, memory_peak_gb, reset_peak
    from kite.bench.scoring import exact_match, f1_score, perplexity, reference_logits
    from kite.bench.states import ensure_state
    from kite.bench.thresholds import device_class, evaluate, load_thresholds
    from kite.upcycle import compare_logits, compress_settings, load_upcycle_config, open_pipeline
    from kite.yoco.health import HealthStore
    from kite.yoco.rules import default_rules_path, load_rules

    # Everything that can be wrong with the input is checked before the model loads.
    thresholds, th_source = load_thresholds(s.thresholds, device_class(s.device))
    names = check_methods(s.baselines + (["budget"] if s.kv_budget_tokens is not None else []))
    if s.kv_budget_tokens is not None:
        BASELINES["budget"](budget_tokens=s.kv_budget_tokens).check()
    cases = load_cases(s.cases, s.families, s.per_family)[: s.max_cases]
    cfg, cfg_path = ucfg = load_upcycle_config(s.upcycle_config)
    compress_settings(cfg, ratio=s.ratio, kept_fraction=s.kept_fraction)   # a bad ratio fails before anything slow
    rules_path = Path(s.rules) if s.rules else default_rules_path()
    notes: list[str] = []
    usable, kv_note = kvpress_status()
    if "kvpress" in names and not usable:
        names.remove("kvpress")
        notes.append(kv_note)

    model_key = (s.model, str(cfg.resolve(cfg.adapter.path, cfg_path)), s.device)
    kept = reuse.model(model_key) if reuse is not None else None
    t_load = time.perf_counter()
    pipe = open_pipeline(s.model, ucfg, ratio=s.ratio, kept_fraction=s.kept_fraction, device=s.device, tagger=False,
                         lm=kept[0] if kept else None)
    if reuse is not None and kept is None:
        reuse.models[model_key] = (pipe.lm, (time.perf_counter() - t_load) * 1e3)
    lm, settings = pipe.lm, pipe.settings
    fp = lm.fingerprints.combined
    ids_of = check_lengths(lm, cases, s.max_new_tokens, s.chat)
    tagger_key = _tagger_key(fp, cfg, cfg_path)
    if reuse is not None and tagger_key in reuse.taggers:
        pipe.tagger = reuse.taggers[tagger_key]
    else:
        pipe.load_tagger(progress)
        if reuse is not None:
            reuse.taggers[tagger_key] = pipe.tagger
    tagger = pipe.tagger
    labels = sorted(set(tagger.labels)) if tagger is not None else None
    rules = load_rules(rules_path, None, lm.geometry.n_layers)
    min_gain = float(s.min_hit_gain)
    methods: dict[str, Method] = {n: BASELINES[n]() for n in names}
    if "budget" in methods:
        if s.kv_budget_tokens is not None:
            methods["budget"] = BASELINES["budget"](budget_tokens=s.kv_budget_tokens)
        methods["budget"].check(lm.geometry.context_length)
    import tempfile

    health_tmp = None
    if s.health_store is None:
        health_tmp = tempfile.TemporaryDirectory(prefix="kite-bench-health-")
    health = HealthStore(Path(s.health_store) if s.health_store else Path(health_tmp.name) / "health.sqlite")
    methods["fused"] = Fused(tagger=tagger, rules=rules, health=health, min_hit_gain=min_gain)
    all_names = [n for n in ALL_METHODS if n in methods]

    result = {
        "kite_bench": 1, "run_id": secrets.token_hex(6), "complete": False, "error": None, "started_at": _now(),
        "finished_at": None,
        "config": {**asdict(s), "codec": settings.codec.name, "n_clusters": settings.n_clusters,
                   "rules_file": str(rules_path), "rules_version": rules.version,
                   "rules_sha256": rules.sha256, "upcycle_config_file": str(cfg_path) if cfg_path else None,
                   "tagger_labels": labels, "yoco_min_hit_gain": min_gain},
        "model": {"spec": str(lm.source.spec), "fingerprint": lm.fingerprints.combined,
                  "geometry": lm.geometry.to_dict()},
        "machine": machine_info(lm.device), "methods": all_names, "notes": notes,
        "cases": [], "cases_total": len(cases), "interrupted": False, "summary": {}, "thresholds": [],
        "thresholds_source": th_source, "passed": None, "targets": [],
    }
    reused = None
    if reuse is not None:
        reused = result["reuse"] = {"model": kept is not None, "model_load_ms": round(kept[1], 1) if kept else 0.0,
                                    "references": 0, "reference_ms": 0.0, "prefills": 0, "prefill_ms": 0.0}

    def ref_key(c: BenchCase) -> tuple:
        return BenchReuse.reference_key(fp, c, ids_of[c.id][1], s.max_new_tokens)
    gen = dict(max_new_tokens=s.max_new_tokens, temperature=0.0)
    docs: dict = {}
    t_run = time.perf_counter()

    def finish(error: str | None, interrupted: bool = False) -> dict:
        rows = result["cases"]
        result["summary"] = report.summarize(rows, all_names) if rows else {}
        fused = result["summary"].get("fused", {}) if rows else {}
        figures = dict(fused)
        if rows:
            figures["memory_peak_gb"] = max(r["memory_peak_gb"] for r in rows)
        result["thresholds"] = evaluate(thresholds, figures)
        result["passed"] = bool(rows) and error is None and all(t["pass"] for t in result["thresholds"])
        result["targets"] = report.targets(result["summary"]) if rows else []
        result["error"], result["interrupted"] = error, interrupted
        result["complete"] = error is None and len(rows) == len(cases)
        result["finished_at"] = _now()
        result["wall_s"] = round(time.perf_counter() - t_run, 1)
        write_result(s.output, result)
        if record is not None:
            record(result)
        return result

    try:
        for i, case in enumerate(cases):
            doc_ids, p_ids, ref_ids = ids_of[case.id]
            if case.document_key not in docs:
                docs.clear()  # one document's caches at a time
                # Full prefill's answers to all its cases kept, and no other method reading the
                # document's full cache: the document need not be prefilled again.
                prefill_ms = reuse.prefills_ms.get((fp, case.document_key)) if reuse is not None else None
                if (prefill_ms is not None and not any(m.needs_document for n, m in methods.items() if n != "full")
                        and all(ref_key(c) in reuse.references for c in cases if c.document_key == case.document_key)):
                    doc = DocumentContext(case.document_key, doc_ids, None, prefill_ms)
                    reused["prefills"] += 1
                    reused["prefill_ms"] = round(reused["prefill_ms"] + prefill_ms, 1)
                else:
                    doc = prefill_document(lm, case.document_key, doc_ids)
                    if reuse is not None:
                        reuse.prefills_ms.setdefault((fp, case.document_key), doc.prefill_ms)
                state = ensure_state(pipe, case.document_key, doc_ids, Path(s.upcycle_dir), progress)
                preps = {}
                for name, m in methods.items():
                    preps[name] = m.prepare(lm, doc, state.state_bytes)
                for name, m in methods.items():
                    if m.uses_state:
                        preps[name].data = state
                docs[case.document_key] = (doc, state, preps)
            doc, state, preps = docs[case.document_key]
            row = {"id": case.id, "family": case.family, "label": case.label, "question": case.question,
                   "reference": case.reference, "document_tokens": doc.n_tokens,
                   "prompt_tokens": len(p_ids), "reference_tokens": len(ref_ids),
                   "document_raw_kv_bytes": doc.raw_kv_bytes(lm),
                   "state": {"file": state.path.name, "bytes": state.state_bytes, "reused": state.reused,
                             "build_ms": round(state.build_ms, 1),
                             "compression_ratio": round(state.compression_ratio, 3),
                             "regenerate_rate": round(state.regenerate_rate, 4)},
                   "methods": {}}
            full_logits = None
            kept_ref = reuse.references.get(ref_key(case)) if reuse is not None else None
            t_ref = time.perf_counter()
            # The reference without any document: did a load help at all?
            ppl_none = (kept_ref.ppl_no_document if kept_ref is not None
                        else perplexity(reference_logits(lm, None, p_ids, ref_ids), ref_ids))
            none_ms = (time.perf_counter() - t_ref) * 1e3
            row["ppl_no_document"] = round(ppl_none, 4)
            for name in all_names:
                if name == "full" and kept_ref is not None:
                    row["methods"]["full"] = copy.deepcopy(kept_ref.row)
                    full_logits = kept_ref.logits
                    reused["references"] += 1
                    reused["reference_ms"] = round(reused["reference_ms"] + kept_ref.cost_ms, 1)
                    if progress:
                        progress("methods", all_names.index(name) + 1, len(all_names))
                    continue
                t_method = time.perf_counter()
                reset_peak(lm.device)
                ans = methods[name].answer(lm, doc, preps[name], case.question, p_ids, gen)
                logits = methods[name].reference_logits(lm, doc, ans, ref_ids)
                if name == "full":
                    full_logits = logits
                ppl = perplexity(logits, ref_ids)
                cmp = compare_logits(full_logits, logits, torch.tensor(ref_ids))
                peak, source = memory_peak_gb(lm.device)
                row["methods"][name] = {
                    "text": ans.text, "answer": answer_text(ans.text),
                    "f1": round(f1_score(answer_text(ans.text), case.reference), 4),
                    "exact_match": exact_match(answer_text(ans.text), case.reference),
                    "ppl": round(ppl, 4), "ttft_ms": round(ans.ttft_ms, 3),
                    "beats_no_document": ppl < ppl_none,
                    "latency_ms": round(ans.latency_ms, 3), "tokens_per_s": ans.tokens_per_s,
                    "new_tokens": ans.new_tokens, "kv_bytes": ans.kv_bytes,
                    "kl_mean": round(cmp["kl_mean"], 5), "top1": round(cmp["top1"], 4),
                    "memory_peak_gb": round(peak, 4), "memory_source": source, "note": preps[name].note,
                    **{k: v for k, v in ans.details.items()}}
                if name == "full" and reuse is not None:
                    reuse.references[ref_key(case)] = Reference(
                        copy.deepcopy(row["methods"]["full"]), logits, ppl_none,
                        (time.perf_counter() - t_method) * 1e3 + none_ms)
                if progress:
                    progress("methods", all_names.index(name) + 1, len(all_names))
            full = row["methods"]["full"]
            for m in row["methods"].values():
                m["ppl_delta"] = round(m["ppl"] - full["ppl"], 4)
                m["f1_delta"] = round(m["f1"] - full["f1"], 4)
            row["memory_peak_gb"], row["memory_source"] = (round(x, 4) if isinstance(x, float) else x
                                                           for x in memory_peak_gb(lm.device))
            result["cases"].append(row)
            write_result(s.output, {**result, "summary": report.summarize(result["cases"], all_names)})
            if progress:
                progress("cases", i + 1, len(cases))
        if s.concurrency:
            result["concurrency"] = _concurrency(s, pipe, cases, ids_of, progress)
    except KeyboardInterrupt:
        finish("interrupted (Ctrl-C)", interrupted=True)
        raise
    except Exception as exc:
        finish(f"case {case.id}: {type(exc).__name__}: {exc}")
        raise
    finally:
        health.close()
        if health_tmp is not None:
            health_tmp.cleanup()
    return finish(None)
