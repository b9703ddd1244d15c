"""benchmarks/regenerator_quality.py with the attention probe reading 256 query rows spread evenly
over the whole document instead of its last 256 (an experiment of issue 14, session 8: the capture
keeps every token's queries, the probe takes ``spread=256`` of them). Same flags as
regenerator_quality.py; use it with ``--choice probe``.

    .venv/bin/python benchmarks/regenerator_probe_spread.py --regenerator U --choice probe \\
        --held-out-contracts 1 --ratios 16 --only GPL-3:16 Apache-2.0:16 --methods regen
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kite.upcycle.compress as compress  # noqa: E402
import regenerator_quality  # noqa: E402
from kite.upcycle.codec import AttentionProbe  # noqa: E402

compress.PROBE_ROWS = 1 << 20   # the capture keeps every token's queries
compress.AttentionProbe = lambda lm, tail, n_tokens: AttentionProbe(lm, tail, n_tokens, spread=256)

if __name__ == "__main__":
    raise SystemExit(regenerator_quality.main(sys.argv[1:]))
