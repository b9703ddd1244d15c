"""What every script under benchmarks/ shares: one timer (:mod:`.timing`), one flag parser base
(:mod:`.flags`), the hardware floors (:mod:`.floors`: the library's GPU table, this CPU measured) and the result
writer (:mod:`.results`: one JSON envelope per run under benchmarks/results/, an index line, every
row printed with its ratio to its baseline and to its floor); a serving benchmark's many streaming
clients in several processes (:mod:`.http_clients`, run as a script by its parent: no torch).

A benchmark script::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # kite, when run as a script
    from harness import Result, bytes_ms, finish, parse, parser, time_ms

    def main(argv=None) -> int:
        ap = parser(__doc__, timing=True)                 # --out --json --device --seed --repeat --warmup
        ap.add_argument("--tokens", type=int, default=16384)
        args = parse(ap, argv)
        res = Result("my_bench", device=args.device)
        base = res.timing("raw step", time_ms(raw, args.repeat, args.warmup, device=args.device))
        res.timing("new step", time_ms(new, args.repeat, args.warmup, device=args.device),
                   baseline=base["name"], floor="KV read once at HBM", floor_value=bytes_ms(kv_bytes))
        # on the CPU: this machine's measured limits (recorded in raw["cpu_limits"]), e.g. a decode step
        # text, ms = cpu_forward_floor(lm, tokens=rows, kv_tokens=kv)  -> floor=text, floor_value=ms
        # and a time with no hardware bound says why: res.row(..., no_floor="a loopback round trip")
        return finish(res, args)                          # prints the rows, writes benchmarks/results/...
"""

from .flags import held_out_flags, held_out_texts, parse, parser
from .floors import (bytes_ms, cpu_bytes_ms, cpu_floor, cpu_flops_ms, cpu_forward_floor, cpu_fp32_text, cpu_limits,
                     cpu_mem_text, flops_ms, gpu_limits, host_link_ms)
from .results import Result, finish
from .timing import Timing, clock, time_ms, wall

__all__ = ["Result", "Timing", "bytes_ms", "clock", "cpu_bytes_ms", "cpu_floor", "cpu_flops_ms", "cpu_forward_floor",
           "cpu_fp32_text", "cpu_limits", "cpu_mem_text", "finish", "flops_ms", "gpu_limits", "held_out_flags", "held_out_texts", "host_link_ms", "parse", "parser",
           "time_ms", "wall"]
