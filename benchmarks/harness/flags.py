"""The flag parser every benchmark extends: ``ap = parser(__doc__, timing=True)``, its own flags on
``ap``, then ``args = parse(ap, argv)``.

Common flags: ``--out`` (the result file; default benchmarks/results/<benchmark>_<machine>_<date>_
<commit>.json), ``--json`` (print the result's JSON on stdout), ``--device`` (auto: cuda when there is
one), ``--seed``; with ``timing``: ``--repeat`` and ``--warmup`` (timed calls, untimed calls first).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from . import results


def parser(doc: str | None, timing: bool = False, repeat: int = 20, warmup: int = 3,
           device: str = "auto") -> argparse.ArgumentParser:
    """The base parser: the description is the docstring's first paragraph, its rest the epilog."""
    head, _, rest = (doc or "").strip().partition("\n\n")
    ap = argparse.ArgumentParser(description=head, epilog=rest or None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("common")
    g.add_argument("--out", type=Path, help="the result file (default: benchmarks/results/, named by the "
                   "benchmark, machine, date and commit)")
    g.add_argument("--json", action="store_true", help="print the result's JSON on stdout")
    g.add_argument("--device", default=device, help="cpu, cuda, cuda:N, or auto (cuda when there is one; "
                   f"default {device})")
    g.add_argument("--seed", type=int, default=0, help="seed of Python's and torch's generators (default 0)")
    if timing:
        g.add_argument("--repeat", type=int, default=repeat, help=f"timed calls per figure (default {repeat})")
        g.add_argument("--warmup", type=int, default=warmup, help=f"untimed calls first (default {warmup})")
    return ap


def held_out_flags(ap: argparse.ArgumentParser, context_tokens: int, continuation_tokens: int) -> None:
    """The flags of a benchmark measured on documents no tuning read (kite.upcycle.study's held-out
    licenses and contracts): ``--model``, ``--texts``, ``--contracts``, ``--ratios``,
    ``--context-tokens``, ``--continuation-tokens``, ``--threads``; :func:`held_out_texts` reads them."""
    from kite.upcycle.study import HELD_OUT

    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--texts", nargs="*", default=list(HELD_OUT), help="licenses under /usr/share/common-licenses")
    ap.add_argument("--contracts", type=int, default=0, help="also this many held-out contracts (default 0)")
    ap.add_argument("--ratios", nargs="+", type=float, default=[4.0, 8.0, 16.0, 20.0])
    ap.add_argument("--context-tokens", type=int, default=context_tokens)
    ap.add_argument("--continuation-tokens", type=int, default=continuation_tokens)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def held_out_texts(args: argparse.Namespace) -> dict[str, str]:
    """The documents :func:`held_out_flags` named: the licenses, then the held-out contracts."""
    from kite.upcycle.study import held_out_docs

    return held_out_docs(args.contracts, licenses=args.texts)


def parse(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse, resolve ``--device auto``, seed the generators; a bad --repeat / --warmup is an argparse
    error. With ``--json`` the script's own prints go to stderr until :func:`~.results.finish` puts
    the result's JSON alone on stdout (``args.stdout``)."""
    args = ap.parse_args(argv)
    if getattr(args, "repeat", 1) < 1 or getattr(args, "warmup", 0) < 0:
        ap.error("--repeat must be >= 1 and --warmup >= 0")
    args.stdout = sys.stdout
    results.note_start()      # the commit the run starts from (a result is written at its end)
    if args.json:
        sys.stdout = sys.stderr
    if args.device == "auto":
        args.device = _auto_device()
    random.seed(args.seed)
    try:
        import torch
    except ImportError:     # a script that needs no torch
        return args
    torch.manual_seed(args.seed)
    return args


def _auto_device() -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
