"""Bases shared across layers: how much of a state's keys and values a basis over g adjacent layers
keeps, against a basis per layer, at the same number of coefficients a token (a design question for
the codec: the regenerator's bases are per layer today).

On the embedded model (CPU), pre-RoPE keys and values [T, H*d] per layer, each layer scaled to unit
variance (its calibration std), so a component's eigenvalue is its share of a layer's relative error.
Bases are fitted on the calibration documents (kite.upcycle.study's calibration licenses long enough
for the context, and two generated contracts of seed 1000; the Grams summed) and applied to the
held-out documents' first ``context_tokens(n)`` tokens. A token keeps ``share`` x layers x H*d
coefficients in all, chosen across the whole state as the codec's state-wide allocation does: the
components of largest calibration eigenvalue, whichever layer or group they belong to. For a group
of g layers the basis is over their g*H*d features together. Baselines: the calibrated basis per
layer (what the regenerator gives today) and the document's own per layer (eigenvalues its own).
Rows: per side and share, the mean over layers and documents of each layer's relative squared
error (error energy / the layer's centred energy), × baseline = against the calibrated per-layer
bases. Energy is not PPL: this says where coefficients can go, not what the model reads.

``--ratios``: then what the model reads. Each held-out document's context coded at R× and read back
(kite.upcycle.study's scoring: the next 512 tokens teacher-forced against the full context), its
coefficients on each basis quantized with the same bits: the codec's key and value bits per element
at R× (``settings_for(R)``), allocated over the whole side of the state by the codec's
``allocate_bits`` (on the document's own variance along each calibrated component, no basis bytes:
the bases are calibrated), each component quantized in groups of the codec's tokens (MSE ranges),
token 0 exact. Not a state file (no clusters, means, headers or layer weights): a comparison of
bases at equal coefficient bits. Rows: the mean PPL delta over the documents per basis, × baseline =
against the calibrated per-layer bases.

    python benchmarks/cross_layer_bases.py --groups 1 2 3 5 --shares 0.1 0.2 0.3 --ratios 16 20
    python benchmarks/cross_layer_bases.py --judge tuning --groups 1 5 6 10 15 30 --shares 0.2 --ratios 16

``--judge tuning`` measures documents neither calibrating nor held out instead, to choose a group
size on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.data.contracts import generate_contracts  # noqa: E402
from kite.model import load_model  # noqa: E402
from kite.upcycle import apply_rope, tokenize_document  # noqa: E402
from kite.upcycle import capture_kv as capture  # noqa: E402
from kite.upcycle.codec import allocate_bits, dequantize, quantize, settings_for  # noqa: E402
from kite.upcycle.study import (CALIBRATION_LICENSES, CONTINUATION, LICENSES, context_tokens, held_out_docs,  # noqa: E402
                                prepare_document)
from harness import Result, clock, finish, parse, parser  # noqa: E402

WHY = "a share of a document's own energy, not a time"


def rows_of(lm, text: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The document's keys (pre-RoPE) and values per layer as [T, H*d] (its first context_tokens(n))."""
    ids = tokenize_document(lm.tokenizer, text)[0]
    c = capture(lm, "", ids=ids[:context_tokens(len(ids))])
    return [_tokens_first(k) for k in c.keys_pre], [_tokens_first(v) for v in c.values]


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[H, T, d] → [T, H*d]: a token's heads side by side, as the codec's joint-head blocks."""
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


def fit(blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, eigenvalues descending, their basis columns) of the rows of ``blocks`` (one per document),
    the eigenvalues per row."""
    x = torch.cat(blocks).double()
    mu = x.mean(0)
    e, u = torch.linalg.eigh((x - mu).T @ (x - mu) / x.shape[0])
    return mu, e.flip(0), u.flip(1)


def kept_per_block(eigen: list[torch.Tensor], total: int) -> list[int]:
    """How many leading components each block keeps when ``total`` are chosen across all blocks by
    eigenvalue (the largest first)."""
    owner = torch.cat([torch.full((len(e),), i) for i, e in enumerate(eigen)])
    top = torch.cat(eigen).topk(total).indices
    return [int((owner[top] == i).sum()) for i in range(len(eigen))]


def layer_errors(x: torch.Tensor, mu: torch.Tensor, u: torch.Tensor, keep: int, width: int) -> list[float]:
    """Each layer's relative squared error when the rows of ``x`` ([T, layers*width]) keep ``keep``
    components of ``u``."""
    x = x.double()
    r = ((x - mu) @ u[:, :keep]) @ u[:, :keep].T + mu
    out = []
    for i in range(x.shape[1] // width):
        a, b = x[:, i * width:(i + 1) * width], r[:, i * width:(i + 1) * width]
        out.append(float((a - b).pow(2).sum() / (a - a.mean(0)).pow(2).sum().clamp_min(1e-30)))
    return out


def state_errors(docs: dict, si: int, scale: list, g: int, fitted, share: float, width: int) -> list[float]:
    """Every layer's relative error in every document, its groups of ``g`` layers on ``fitted(doc,
    start)``'s bases, ``share`` x layers x width components kept across the state."""
    n_layers = len(scale)
    out = []
    for doc in docs.values():
        groups = [(start, fitted(doc, start)) for start in range(0, n_layers, g)]
        keep = kept_per_block([f[1] for _, f in groups], round(share * n_layers * width))
        for (start, (mu, _, u)), k in zip(groups, keep):
            x = torch.cat([doc[si][j] / scale[j] for j in range(start, start + g)], 1)
            out += layer_errors(x, mu, u, k, width)
    return out


def coded_side(rows: list[torch.Tensor], scale: list, g: int, bases: dict, bits_per_element: float, s) -> list:
    """One side of a document ([T, H*d] per layer) coded on groups of ``g`` layers' bases at
    ``bits_per_element`` (the state-wide allocation, each component quantized in token groups),
    token 0 exact; decoded, per layer [T, H*d]."""
    T, W, n_layers = rows[0].shape[0], rows[0].shape[1], len(rows)
    coefs, blocks = [], []
    for start in range(0, n_layers, g):
        mu, _, u = bases[(g, start)]
        x = torch.cat([rows[j][1:] / scale[j] for j in range(start, start + g)], 1).double()
        coefs.append((x - mu) @ u)
        blocks.append((start, mu, u))
    evals = torch.stack([y.var(0) for y in coefs])         # the document's own variance per component
    bits = allocate_bits(evals, bits_per_element * (T - 1) * W * n_layers, T - 1, g * W, s, basis_stored=False)
    out = [None] * n_layers
    for (start, mu, u), y, b in zip(blocks, coefs, bits):
        yq = torch.zeros_like(y)
        for width in sorted(set(b.tolist()) - {0}):
            idx = (b == width).nonzero()[:, 0]
            yq[:, idx] = dequantize(quantize(y[:, idx].float(), f"int{width}", group_size=s.group_size, axis=0,
                                             range_mode="mse")).double()
        x = yq @ u.T + mu
        for i, j in enumerate(range(start, start + g)):
            out[j] = torch.cat([rows[j][:1], (x[:, i * W:(i + 1) * W] * scale[j]).float()])
    return out


def ppl_rows(lm, res: Result, raw: dict, texts: dict, ratios: list[float], groups: list[int], scales: dict,
             bases: dict) -> None:
    """Per ratio and basis, the mean PPL delta of the documents ``texts`` coded as :func:`coded_side` codes."""
    deltas: dict[tuple[float, int], list[float]] = {}
    for name, text in texts.items():
        doc = prepare_document(lm, name, text)
        H, T, d = doc.cap.keys_pre[0].shape
        sides = [[x.permute(1, 0, 2).reshape(T, H * d) for x in xs] for xs in (doc.cap.keys_pre, doc.cap.values)]
        for ratio in ratios:
            s = settings_for(ratio)
            for g in groups:
                k, v = (coded_side(sides[si], scales[si], g, bases[si], b, s) for si, b in enumerate((s.k_bits, s.v_bits)))
                keys = [apply_rope(x.reshape(T, H, d).permute(1, 0, 2), doc.cos, doc.sin) for x in k]
                m = doc.score(keys, [x.reshape(T, H, d).permute(1, 0, 2).contiguous() for x in v])
                deltas.setdefault((ratio, g), []).append(m["ppl_other"] - m["ppl_full"])
                raw["ppl"].append({"document": name, "ratio": ratio, "group": g, "ppl_delta": m["ppl_other"] - m["ppl_full"]})
    for ratio in ratios:
        base = f"{ratio:g}x, equal coefficient bits: mean PPL delta, calibrated basis per layer"
        for g in sorted(groups):
            got = deltas[(ratio, g)]
            name = base if g == 1 else f"{ratio:g}x, equal coefficient bits: mean PPL delta, calibrated basis over {g} layers"
            extra = {} if g == 1 or 1 not in groups else {"baseline": base}
            res.row(name, sum(got) / len(got), "ppl", no_floor="a quality figure", largest=max(got), **extra)


def tuning_docs() -> dict[str, str]:
    """Documents to choose settings on: neither the calibration's nor held out."""
    docs = {name: (LICENSES / name).read_text() for name in ("GPL-2", "LGPL-3")}
    docs.update({r["id"]: r["text"] for r in generate_contracts(2, tokens=2700, seed=2000)})
    return docs


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--groups", type=int, nargs="*", default=[1, 2, 3, 5], help="layers a shared basis spans")
    ap.add_argument("--shares", type=float, nargs="*", default=[0.1, 0.2, 0.3],
                    help="components kept, as a share of a layer's H*d")
    ap.add_argument("--ratios", type=float, nargs="*", default=[],
                    help="also code the held-out documents at these ratios and score them (PPL)")
    ap.add_argument("--judge", choices=["held-out", "tuning"], default="held-out",
                    help="the documents measured: the held-out set, or tuning documents to choose a group size on "
                         "(GPL-2, LGPL-3, two contracts of seed 2000: neither calibrating nor held out)")
    ap.add_argument("--threads", type=int, default=2)
    args = parse(ap, argv)
    torch.set_num_threads(args.threads)
    t0 = clock()
    lm = load_model(None)
    n_layers = lm.geometry.n_layers
    if any(g < 1 or n_layers % g for g in args.groups):
        ap.error(f"--groups: each must divide the model's {n_layers} layers")
    cal_texts = [(LICENSES / n).read_text() for n in CALIBRATION_LICENSES]
    cal_texts = [t for t in cal_texts if len(tokenize_document(lm.tokenizer, t)[0]) >= 2048 + CONTINUATION]
    cal_texts += [r["text"] for r in generate_contracts(2, tokens=2700, seed=1000)]
    cal = [rows_of(lm, t) for t in cal_texts]
    judged = held_out_docs(2) if args.judge == "held-out" else tuning_docs()
    measured = {name: rows_of(lm, t) for name, t in judged.items()}
    res = Result("cross_layer_bases", device="cpu")
    raw = {"calibration_documents": len(cal), "judged": args.judge, "documents": list(measured), "cells": [], "ppl": []}
    scales, all_bases = {}, {}
    for si, side in enumerate("kv"):
        width = cal[0][si][0].shape[1]
        scale = scales[si] = [torch.cat([c[si][layer] for c in cal]).std() for layer in range(n_layers)]
        bases = all_bases[si] = {(g, start): fit([torch.cat([c[si][j] / scale[j] for j in range(start, start + g)], 1)
                                                  for c in cal])
                                 for g in args.groups for start in range(0, n_layers, g)}
        for share in args.shares:
            cells = {"own": state_errors(measured, si, scale, 1, lambda doc, start: fit([doc[si][start] / scale[start]]),
                                         share, width)}
            for g in args.groups:
                cells[g] = state_errors(measured, si, scale, g, lambda doc, start: bases[(g, start)], share, width)
            base = f"{side}, {share:.0%} of coefficients: calibrated basis per layer"
            for what, errs in sorted(cells.items(), key=lambda kv: (kv[0] != 1, str(kv[0]))):
                name = (base if what == 1 else f"{side}, {share:.0%} of coefficients: the document's own basis per layer"
                        if what == "own" else f"{side}, {share:.0%} of coefficients: calibrated basis over {what} layers")
                mean = sum(errs) / len(errs)
                extra = {} if what == 1 or 1 not in args.groups else {"baseline": base}
                res.row(name, mean, "rel sq error", no_floor=WHY, **extra)
                raw["cells"].append({"side": side, "share": share, "basis": str(what), "mean": mean})
    if args.ratios:
        ppl_rows(lm, res, raw, judged, args.ratios, args.groups, scales, all_bases)
    raw["seconds"] = round(clock() - t0, 1)
    res.raw.update(raw)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
