"""Upcycle speed on this machine: compress cost and time to first token from a state vs prefill.

Side by side in one run, on the embedded model (or --model): a --tokens document (GPL-3 text,
then Apache-2.0, repeated as needed), a short question after it.

  prefill     forward over document + question, first token out (the baseline)
  compress    capture + spans + clusters + tags + codec + write (the state is made once)
  ttft/state  read + decode the state + forward over the question, first token out

Prints a table and --json; every ratio is against the prefill measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--settings", nargs="+", default=["ratio=4", "ratio=8", "int4"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from kite.model import load_model
    from kite.runtime.generate import generate
    from kite.upcycle import CompressSettings, codec_settings, compress_document, load_prefix, tokenize_document

    lm = load_model(args.model)
    texts = [Path("/usr/share/common-licenses/GPL-3").read_text(), Path("/usr/share/common-licenses/Apache-2.0").read_text()]
    ids: list[int] = []
    while len(ids) < args.tokens:
        ids += tokenize_document(lm.tokenizer, texts[len(ids) % 2 and 1])[0]
    doc = ids[: args.tokens]
    question = lm.tokenizer("\nQuestion: what does this license require? Answer:", add_special_tokens=False)["input_ids"]

    def best(fn, n):
        times = []
        out = None
        for _ in range(n):
            t = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times), out

    prefill_ms, _ = best(lambda: generate(lm, doc + question, max_new_tokens=1, stop_ids=set()), args.repeats)
    rows = [{"step": "prefill document + question → first token", "ms": round(prefill_ms, 1), "vs_prefill": 1.0}]
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.settings:
            path = Path(tmp) / f"{spec}.upc"
            settings = CompressSettings(codec=codec_settings(spec))
            comp_ms, made = best(lambda: compress_document(lm, "", path, settings, ids=doc), 1)
            load_ms, loaded = best(lambda: load_prefix(path, lm), args.repeats)
            prefix = loaded[0]
            ttft_ms, gen = best(lambda: (lambda p: generate(lm, question, max_new_tokens=1, prefix=p, stop_ids=set()))(
                load_prefix(path, lm)[0]), args.repeats)
            first_fwd = gen.ttft_ms
            rows += [
                {"step": f"{spec}: compress (state {made.state_bytes:,} B, {made.compression_ratio:.2f}×)",
                 "ms": round(comp_ms, 1), "vs_prefill": round(comp_ms / prefill_ms, 3),
                 "parts": made.timings_ms},
                {"step": f"{spec}: load state (read + decode + RoPE)", "ms": round(load_ms, 1),
                 "vs_prefill": round(load_ms / prefill_ms, 3)},
                {"step": f"{spec}: question forward after the state", "ms": round(first_fwd, 1),
                 "vs_prefill": round(first_fwd / prefill_ms, 3)},
                {"step": f"{spec}: time to first token from the state", "ms": round(ttft_ms, 1),
                 "vs_prefill": round(ttft_ms / prefill_ms, 3), "speedup": round(prefill_ms / ttft_ms, 2)},
            ]
            del prefix
    report = {"model": lm.source.spec, "tokens": len(doc), "question_tokens": len(question),
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "load_average": os.getloadavg(), "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['model']}, {report['tokens']} tokens, {report['threads']} threads, load {report['load_average']}")
    for r in rows:
        extra = f"  ({r['speedup']}× faster)" if "speedup" in r else ""
        print(f"  {r['step']:<62} {r['ms']:>10.1f} ms  {r['vs_prefill']:>6.3f}× prefill{extra}")


if __name__ == "__main__":
    main()
