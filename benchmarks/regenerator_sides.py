"""Which (layer, side) codecs of a state take the document's own basis rather than the
regenerator's, under the expected rule and the attention probe (GPL-3 and Apache-2.0 at 16x; issue 14,
docs/PERFORMANCE.md "Training", session 8), with the compress timings.

    .venv/bin/python benchmarks/regenerator_sides.py REGENERATOR_DIR OUT.json
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.model import load_model  # noqa: E402
from kite.upcycle import CompressSettings, codec, codec_settings, compress_document, tokenize_document  # noqa: E402
from kite.upcycle.format import StateFile  # noqa: E402
from kite.upcycle import Regenerator  # noqa: E402
from kite.upcycle.format import blob_key  # noqa: E402

torch.set_num_threads(2)
lm = load_model(None)
reg = Regenerator.load(sys.argv[1])
out = {}
for doc, ratio in (("GPL-3", 16), ("Apache-2.0", 16)):
    text = Path("/usr/share/common-licenses", doc).read_text()
    ids, _ = tokenize_document(lm.tokenizer, text)
    ctx = min(2048, len(ids) - 512)
    for choice in ("expected", "probe"):
        reg.choice = None if choice == "expected" else "probe"
        with tempfile.TemporaryDirectory() as d:
            r = compress_document(lm, "", Path(d) / "s.upc", CompressSettings(codec=codec_settings(ratio), n_clusters=8),
                                  ids=ids[:ctx], regenerator=reg)
            with StateFile(r.path) as sf:
                modes = []
                for layer in range(lm.geometry.n_layers):
                    lc = codec.from_bytes(sf.read(blob_key(None, layer)), codec.LayerCodec)
                    modes.append("".join("R" if lc.meta[s]["mode"] == "rpca" else "d" for s in "kv"))
        out[f"{doc}:{ratio}:{choice}"] = {"doc_sides_k": [i for i, m in enumerate(modes) if m[0] == "d"],
                                          "doc_sides_v": [i for i, m in enumerate(modes) if m[1] == "d"],
                                          "compress_ms": r.timings_ms}
        print(json.dumps({f"{doc}:{ratio}:{choice}": out[f"{doc}:{ratio}:{choice}"]}), flush=True)
Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
