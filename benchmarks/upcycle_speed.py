"""Upcycle speed on this machine: compress cost and time to first token from a state vs prefill.

Side by side in one run, on the embedded model (or --model): a --tokens document (GPL-3 text,
then Apache-2.0, repeated as needed), a short question after it.

  prefill     forward over document + question, first token out (the baseline)
  compress    capture + spans + clusters + tags + codec + write (the state is made once)
  ttft/state  read + decode the state + forward over the question, first token out

Every row's baseline is the prefill measured in the same run (medians of --repeat); the prefill's
floor is 2 x parameters x tokens FLOPs at the GPU's bf16 tensor rate, or on a CPU the larger of that
at its measured fp32 rate and the weights read once (harness.floors.cpu_forward_floor); loading a
state and the first token from it have the state's bytes read once (and on the CPU the question's
forward over the document's KV) as theirs.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, flops_ms, parse, parser, time_ms  # noqa: E402
from harness.floors import bf16_text, cpu_bytes_ms, cpu_forward_floor, cpu_mem_text, host_link_ms, host_link_text  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=3, warmup=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--settings", nargs="+", default=["ratio=4", "ratio=8", "int4"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--regenerator", type=Path, help="also code each ratio setting on this regenerator folder (rows "
                    "named '... on the regenerator'), side by side")
    ap.add_argument("--entropy-coding", action="store_true", help="also code each setting with its codes entropy "
                    "coded (compression.entropy_coding; rows named '..., entropy coded'), side by side")
    args = parse(ap, argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from kite.model import load_model
    from kite.runtime.generate import generate
    from kite.upcycle import (CompressSettings, Regenerator, codec_settings, compress_document, load_prefix,
                              tokenize_document)

    lm = load_model(args.model, device=args.device)
    texts = [Path("/usr/share/common-licenses/GPL-3").read_text(), Path("/usr/share/common-licenses/Apache-2.0").read_text()]
    ids: list[int] = []
    while len(ids) < args.tokens:
        ids += tokenize_document(lm.tokenizer, texts[len(ids) % 2 and 1])[0]
    doc = ids[: args.tokens]
    question = lm.tokenizer("\nQuestion: what does this license require? Answer:", add_special_tokens=False)["input_ids"]

    res = Result("upcycle_speed", device=lm.device)

    def best(fn, n):
        out = []
        t = time_ms(lambda: out.append(fn()), n, args.warmup, device=lm.device)
        return t, out[-1]

    n_params = sum(p.numel() for p in lm.model.parameters())
    on_gpu = str(lm.device).startswith("cuda")
    prefill = "prefill document + question -> first token"
    work = 2 * n_params * (len(doc) + len(question))
    what = f"2 x {n_params / 1e6:.0f}M parameters x {len(doc) + len(question)} tokens"
    floor = (f"{what} {bf16_text()}", flops_ms(work)) if on_gpu else \
        cpu_forward_floor(lm, len(doc) + len(question), what="the prefill")

    def state_floor(path: Path, first_token: bool) -> dict:
        """The state's bytes read once; with the first token, beside the question's forward over the KV."""
        n = path.stat().st_size
        if on_gpu:
            return {"floor": f"the state ({n / 1e6:.3g} MB) to the GPU once {host_link_text()}",
                    "floor_value": host_link_ms(n)}
        if first_token:
            text, ms = cpu_forward_floor(lm, len(question), len(doc), what="the question's forward")
            return {"floor": f"the state ({n / 1e6:.3g} MB) read once {cpu_mem_text()} + {text}",
                    "floor_value": cpu_bytes_ms(n) + ms}
        return {"floor": f"the state ({n / 1e6:.3g} MB) read once {cpu_mem_text()}", "floor_value": cpu_bytes_ms(n)}

    doc_floor = (f"the document's forward: 2 x {n_params / 1e6:.0f}M parameters x {len(doc)} tokens {bf16_text()}",
                 flops_ms(2 * n_params * len(doc))) if on_gpu else cpu_forward_floor(lm, len(doc), what="the document's forward")
    t, _ = best(lambda: generate(lm, doc + question, max_new_tokens=1, stop_ids=set()), args.repeat)
    res.timing(prefill, t, floor=floor[0], floor_value=floor[1])
    reg = Regenerator.load(args.regenerator) if args.regenerator else None
    runs = [(spec, None) for spec in args.settings]
    if reg is not None:
        runs += [(f"{spec} on the regenerator", spec) for spec in args.settings if spec.startswith("ratio=")]
    if args.entropy_coding:
        runs += [(f"{label}, entropy coded", on or label) for label, on in runs]
    with tempfile.TemporaryDirectory() as tmp:
        for spec, on in runs:
            path = Path(tmp) / f"{len(list(Path(tmp).iterdir()))}.upc"
            settings = CompressSettings(codec=codec_settings(on or spec), entropy_coding=spec.endswith("entropy coded"))
            regen = reg if on is not None and "on the regenerator" in spec else None
            t, made = best(lambda: compress_document(lm, "", path, settings, ids=doc, regenerator=regen), 1)
            res.timing(f"{spec}: compress", t, baseline=prefill, floor=f"holds {doc_floor[0]}",
                       floor_value=doc_floor[1], state_bytes=made.state_bytes,
                       compression_ratio=round(made.compression_ratio, 3), parts=made.timings_ms)
            t, _ = best(lambda: load_prefix(path, lm, regenerator=regen), args.repeat)
            res.timing(f"{spec}: load state (read + decode + RoPE)", t, baseline=prefill, **state_floor(path, False))
            t, gen = best(lambda: generate(lm, question, max_new_tokens=1,
                                           prefix=load_prefix(path, lm, regenerator=regen)[0], stop_ids=set()),
                          args.repeat)
            q_floor = {} if on_gpu else dict(zip(("floor", "floor_value"), cpu_forward_floor(
                lm, len(question), len(doc), what="the question's forward")))
            res.row(f"{spec}: question forward after the state", gen.ttft_ms, "ms", baseline=prefill, **q_floor)
            res.timing(f"{spec}: time to first token from the state", t, baseline=prefill, **state_floor(path, True))
    report = {"model": lm.source.spec, "tokens": len(doc), "question_tokens": len(question),
              "regenerator": None if reg is None else {"fingerprint": reg.fingerprint,
                                                       "layer_groups": reg.meta.get("layer_groups")},
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    res.raw.update(report)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
