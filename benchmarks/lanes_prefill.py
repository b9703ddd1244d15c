"""A question over states held in lanes, on a GPU: the lanes kernel's attention of T query tokens a state
(a newcomer's prefill in `kite serve --resident lanes`), one layer of Qwen2-7B geometry (4 KV heads, 7
query heads each, head_dim 128), N states of 16K tokens, 4-bit lanes (128 key lanes, 64 value lanes,
groups of 512, one sink). Two ways side by side in one run:

* ``a token an entry``: each of a state's T tokens is its own entry of the kernel's plan (the state
  repeated T times): the state is read once per token;
* ``tokens folded``: the tokens are more query heads of their state, a chunk of them an entry
  (kite.kernels.lanes_triton.lanes_attend_tokens, up to FOLDED_ROWS rows a KV head an entry).

Each timed as a CUDA graph replay (harness.time_ms); the outputs are compared with each other. The
floor: the states' lanes read once at the GPU's HBM bandwidth (harness.floors).

    python3 benchmarks/lanes_prefill.py [--states 32] [--query 32] [--tokens 16384]
    TRITON_INTERPRET=1 python3 benchmarks/lanes_prefill.py --cpu-smoke     # the script runs (no graphs)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_speed import capture  # noqa: E402
from harness import Result, bytes_ms, finish, parse, parser, time_ms  # noqa: E402
from harness.floors import hbm_text  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=20, warmup=2, device="cuda")
    ap.add_argument("--states", type=int, default=32)
    ap.add_argument("--query", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--folded", type=int, nargs="+", default=None,
                    help="folded rows a program (lanes_triton.FOLDED_ROWS) to time, each a row (default: its value)")
    ap.add_argument("--cpu-smoke", action="store_true", help="2 states of 1,024 tokens, 4 tokens a question, on "
                    "the CPU (under TRITON_INTERPRET=1), each way called, not captured")
    args = parse(ap, ["--device", "cpu", "--repeat", "1", "--warmup", "0", *(argv or sys.argv[1:])]
                 if "--cpu-smoke" in (argv or sys.argv[1:]) else argv)
    if args.cpu_smoke:
        from kite.testing.triton_interpreter import bridge_interpreter_gaps

        bridge_interpreter_gaps()
        args.states, args.query, args.tokens = 2, 4, 1024
    dev = args.device

    from kite.kernels import lanes_triton
    from kite.kernels.lanes_triton import LanesPlan, lanes_attend_tokens, lanes_decode
    from kite.upcycle.codec import encode_lanes

    H, G, d, N, T = 4, 7, 128, args.states, args.query
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(H, d, d, generator=gen) * (0.97 ** torch.arange(d))[None, :, None]
    k = (torch.randn(H, args.tokens, d, generator=gen) @ A + 1.0).to(dev)
    v = (torch.randn(H, args.tokens, d, generator=gen) @ A).to(dev)
    (one,) = encode_lanes([k], [v], 128, 64, group=512, sinks=1)
    states = [dataclasses.replace(one, **{f.name: getattr(one, f.name).clone() for f in dataclasses.fields(one)
                                          if isinstance(getattr(one, f.name), torch.Tensor)}) for _ in range(N)]
    q = torch.randn(N, H * G, T, d, generator=gen).to(dev, torch.bfloat16 if dev != "cpu" else torch.float32)
    scale = d ** -0.5
    folded_plan = LanesPlan(states)
    entry_plan = LanesPlan([x for x in states for _ in range(T)])

    def per_token():
        o, lse = lanes_decode(q.transpose(1, 2).reshape(N * T, H * G, d), entry_plan, scale,
                              entry_plan.raw_k, entry_plan.raw_v)
        return o.view(N, T, H * G, d).transpose(1, 2)

    plans = {1: folded_plan}

    def plan_for(chunks):
        if chunks not in plans:
            plans[chunks] = LanesPlan([x for x in states for _ in range(chunks)])
        return plans[chunks]

    def folded():
        return lanes_attend_tokens(q, plan_for, scale, H)[0]

    lanes_bytes = sum(t.numel() * t.element_size() for t in (one.k_codes, one.v_codes)) * N
    floor = bytes_ms(lanes_bytes)
    floor_text = f"{N} states' lane codes read once {hbm_text()}"
    res = Result("lanes_prefill", device=dev)

    def timed(fn):
        if dev == "cpu":
            return time_ms(fn, args.repeat, args.warmup)
        return time_ms(capture(fn)[0].replay, args.repeat, args.warmup, device=dev)

    base = f"{T}-token question over {N} states in lanes, a token an entry"
    with torch.inference_mode():
        a = per_token()
        t_base = timed(per_token)
        res.timing(base, t_base, floor=floor_text, floor_value=floor)
        print(f"a token an entry {t_base.median_ms:.3f} ms, floor {floor:.3f} ms", flush=True)
        for rows in args.folded or [lanes_triton.FOLDED_ROWS]:
            lanes_triton.FOLDED_ROWS = rows
            b = folded()
            err = float((a - b).abs().max()) / float(a.abs().max())
            t = timed(folded)
            res.timing(f"{T}-token question over {N} states in lanes, tokens folded ({rows} rows a KV head an entry)",
                       t, baseline=base, floor=floor_text, floor_value=floor, max_rel_diff_vs_base=err)
            print(f"folded {rows}: {t.median_ms:.3f} ms ({t_base.median_ms / t.median_ms:.1f}x), max rel diff "
                  f"{err:.2e}", flush=True)
    res.raw.update(folded_rows=args.folded or [lanes_triton.FOLDED_ROWS], states=N, query=T, tokens=args.tokens, heads=H, group_heads=G, head_dim=d, floor_ms=floor,
                   layers_note="one layer; a 28-layer model reads 28 of these a prefill step")
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
