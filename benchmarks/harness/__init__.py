"""What every script under benchmarks/ shares: one timer (:mod:`.timing`), one flag parser base
(:mod:`.flags`), the hardware floors from the library's GPU table (:mod:`.floors`) and the result
writer (:mod:`.results`: one JSON envelope per run under benchmarks/results/, an index line, every
row printed with its ratio to its baseline and to its floor)."""

from .flags import parse, parser
from .floors import bytes_ms, flops_ms, gpu_limits, host_link_ms
from .results import Result, finish
from .timing import Timing, clock, time_ms, wall

__all__ = ["Result", "Timing", "bytes_ms", "clock", "finish", "flops_ms", "gpu_limits", "host_link_ms", "parse",
           "parser", "time_ms", "wall"]
