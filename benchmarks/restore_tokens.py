"""Learned recovery over a compressed state: how much of its PPL gap it wins back (embedded model).

Two forms the field uses, alone or together (``--forms``): RestoreKV's restore tokens, R key/value
pairs per layer placed before a loaded state's KV; and a correction of the state's decoded keys and
values (a scale per rotary pair and head on the keys, a linear map per head added to the values).
Both are shared by every document and trained so that the continuation read after the state
matches the full context's next-token distributions (the mean KL over the continuation, the model
frozen). The states are the codec's at ``--ratio`` on the regenerator's
calibrated bases (``--layer-group``: 30 is one basis for the whole state, the embedded model's best;
such bases weigh their features by attention and their layers by the layer weights KITE ships for
the model), as `kite upcycle train` makes them.

Training documents: generated contracts of seed 3000 (neither the regenerator's calibration, seed
1000, nor the held-out ones, seed 23, draw it), the calibration licenses and, with ``--texts``,
windows of other texts. Held out, never trained
or calibrated on: GPL-3, Apache-2.0 and ``--held-out-contracts`` generated contracts, each scored as
`kite upcycle eval` scores it (its context, then 512 continuation tokens, tokens 2..N; PPL delta
against the full context, KL). Recovery = 1 - the mean delta with the form / the mean delta
without.

    .venv/bin/python benchmarks/restore_tokens.py --train-contracts 8 --epochs 3     # CPU, a small run
    .venv/bin/python benchmarks/restore_tokens.py --forms tokens correction both
    python3 benchmarks/restore_tokens.py --model smollm2.gguf --device cuda --train-contracts 200
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kite.data.contracts import generate_contracts  # noqa: E402
from kite.model import load_model  # noqa: E402
from kite.runtime.generate import cache_kwarg  # noqa: E402
from kite.upcycle import (CompressSettings, codec_settings, compare_logits, compress_document, load_prefix,  # noqa: E402
                          tokenize_document)
from kite.upcycle.study import CALIBRATION_LICENSES, CONTINUATION, LICENSES, context_tokens, held_out_docs  # noqa: E402
from kite.upcycle.codec import shipped_for  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402
from regenerator_quality import fit_regenerator  # noqa: E402

TRAIN_SEED = 3000
FORMS = ("tokens", "correction", "both")


class Recovery:
    """What a recovery form learns, shared by every document, applied to a loaded state's KV a layer at
    a time: ``tokens`` R key/value pairs placed before the state (keys learnt where RoPE has already
    turned them: they have no position); ``correction`` the state's decoded keys scaled per rotary
    pair and head (a scale that commutes with RoPE's rotation: an attention temperature per frequency)
    and its values plus a learnt linear map of them per head; ``both``. Every parameter starts at zero:
    a zero correction is the identity, a zero token a logit-0 key with a zero value."""

    def __init__(self, form: str, layers: int, heads: int, dim: int, tokens: int, device):
        def zeros(*shape):
            return torch.zeros(*shape, device=device, requires_grad=True)

        self.form = form
        self.tokens = (zeros(layers, heads, tokens, dim), zeros(layers, heads, tokens, dim)) \
            if form in ("tokens", "both") else None
        self.correction = (zeros(layers, heads, dim // 2), zeros(layers, heads, dim, dim)) \
            if form in ("correction", "both") else None

    def parameters(self) -> list[torch.Tensor]:
        return [t for pair in (self.tokens, self.correction) if pair is not None for t in pair]

    def groups(self, lr: float, correction_lr: float) -> list[dict]:
        """Adam's parameter groups: a step moves every entry by about its rate, so the correction's
        64 x 64 maps (each output a sum of 64 entries' moves) learn at a rate of their own."""
        return [g for g in ({"params": list(self.tokens or ()), "lr": lr},
                            {"params": list(self.correction or ()), "lr": correction_lr}) if g["params"]]

    def apply(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[H, T, d] keys and values of one layer's state, as the continuation reads them."""
        if self.correction is not None:
            s, a = self.correction[0][layer], self.correction[1][layer]
            k = k * (1 + torch.cat([s, s], -1)).to(k.dtype)[:, None, :]
            v = v + torch.einsum("htd,hde->hte", v, a.to(v.dtype))
        if self.tokens is not None:
            k = torch.cat([self.tokens[0][layer].to(k.dtype), k], 1)
            v = torch.cat([self.tokens[1][layer].to(v.dtype), v], 1)
        return k, v


class Sample:
    """One document: its context's loaded state, its continuation ids and the full context's logits over it."""

    def __init__(self, lm, name: str, ids: list[int], ctx_len: int, cont_len: int, settings, reg):
        import tempfile

        from kite.runtime.cache import new_cache
        from kite.runtime.generate import forward_tokens

        self.name = name
        self.ctx, self.cont = ids[:ctx_len], ids[ctx_len:ctx_len + cont_len]
        with torch.inference_mode():
            cache = new_cache(lm.model)
            forward_tokens(lm.model, self.ctx, cache, 0)
            full = forward_tokens(lm.model, self.cont, cache, len(self.ctx))[:-1].float()
            with tempfile.TemporaryDirectory() as tmp:
                made = compress_document(lm, lm.tokenizer.decode(self.ctx), Path(tmp) / "s.upc", settings,
                                         ids=self.ctx, regenerator=reg)
                prefix, _ = load_prefix(Path(tmp) / "s.upc", lm, regenerator=reg)
        p = next(lm.model.parameters())     # copies made outside inference mode: autograd may save them
        self.keys = [k.to(p.device, p.dtype).clone() for k in prefix.keys]        # [H_kv, T, d] a layer
        self.values = [v.to(p.device, p.dtype).clone() for v in prefix.values]
        self.full = full.clone()
        self.start = prefix.next_position
        self.ratio = made.compression_ratio
        self.targets = torch.tensor(self.cont[1:])

    def logits(self, lm, recovery: Recovery | None) -> torch.Tensor:
        """The continuation's logits [n - 1, vocab] read after the state (with ``recovery`` applied)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=lm.model.config)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            if recovery is not None:
                k, v = recovery.apply(layer, k, v)
            cache.update(k.unsqueeze(0), v.unsqueeze(0), layer)
        dev = self.keys[0].device
        ids = torch.as_tensor(self.cont, device=dev).view(1, -1)
        pos = torch.arange(self.start, self.start + ids.shape[1], device=dev).unsqueeze(0)
        out = lm.model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(lm.model): cache})
        return out.logits[0, :-1].float()

    def kl(self, lm, recovery: Recovery | None) -> torch.Tensor:
        full = torch.log_softmax(self.full, -1)
        logp = torch.log_softmax(self.logits(lm, recovery), -1)
        return (full.exp() * (full - logp)).sum(-1).mean()


def train_form(lm, form: str, train: list[Sample], args) -> tuple[Recovery, list[float], float]:
    """The form trained on ``train`` for ``args.epochs`` (Adam, one document a step): (it, the mean
    training KL of each epoch, seconds)."""
    H, _, d = train[0].keys[0].shape
    rec = Recovery(form, len(train[0].keys), H, d, args.tokens, train[0].keys[0].device)
    opt = torch.optim.Adam(rec.groups(args.lr, args.correction_lr))
    order, rng, log, t0 = list(range(len(train))), random.Random(args.seed), [], clock()
    for epoch in range(args.epochs):
        rng.shuffle(order)
        total = 0.0
        for i in order:
            loss = train[i].kl(lm, rec)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
        log.append(round(total / len(order), 5))
        print(f"{form}: epoch {epoch + 1}/{args.epochs}, training KL {log[-1]:.5f}", file=sys.stderr, flush=True)
    return rec, log, clock() - t0


def text_windows(lm, args, held_out) -> list[tuple[str, list[int], list[int]]]:
    """(name, context ids, continuation ids) of up to ``--max-windows`` windows of the ``--texts`` (one a
    text, `kite data pairs --texts`' windows: 2,048 tokens and the ``--train-continuation`` after them),
    a window sharing over 1 % of its 13-word runs with a held-out document dropped."""
    if not args.texts:
        return []
    from kite.data.texts import read_texts, text_pairs

    def tokenize(text: str) -> list[int]:
        return lm.tokenizer(text, add_special_tokens=False)["input_ids"]

    made = text_pairs(read_texts(args.texts, "--texts"), tokenize, lm.tokenizer.decode, window_tokens=2048,
                      pairs_per_window=1, prompt_tokens=8, response_tokens=args.train_continuation - 8,
                      windows_per_text=1, max_windows=args.max_windows, exclude=list(held_out), seed=args.seed)
    print(f"--texts: {made.windows} windows of {made.texts} texts ({made.too_short} too short, {made.excluded} "
          "sharing a held-out document's text)", file=sys.stderr, flush=True)
    return [(r["id"], tokenize(r["context"]), tokenize(r["prompt"] + r["response"])) for r in made.records]


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--model", help="HF folder or .gguf file (default: the embedded model)")
    ap.add_argument("--forms", nargs="+", choices=FORMS, default=["tokens"])
    ap.add_argument("--ratio", type=float, default=16.0)
    ap.add_argument("--layer-group", type=int, default=30)
    ap.add_argument("--calibration-contracts", type=int, default=6)
    ap.add_argument("--train-contracts", type=int, default=24)
    ap.add_argument("--train-continuation", type=int, default=256, help="continuation tokens a training document")
    ap.add_argument("--held-out-contracts", type=int, default=2)
    ap.add_argument("--texts", nargs="*", help="also train on windows of these texts (files or folders, as `kite "
                    "data pairs --texts`; windows sharing a held-out document's text are dropped)")
    ap.add_argument("--max-windows", type=int, default=64, help="with --texts: at most this many windows")
    ap.add_argument("--tokens", type=int, default=8, help="restore tokens a layer (default 8)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2, help="the restore tokens' learning rate (default 1e-2)")
    ap.add_argument("--correction-lr", type=float, default=5e-4, help="the correction's (default 5e-4)")
    ap.add_argument("--threads", type=int, default=2)
    args = parse(ap, argv)
    for name in ("ratio", "layer_group", "train_contracts", "train_continuation", "tokens", "epochs", "lr", "correction_lr", "max_windows"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.train_continuation < 16:
        ap.error("--train-continuation must be at least 16 (a window's 8 prompt tokens and its response)")
    torch.set_num_threads(args.threads)
    t0 = clock()
    lm = load_model(args.model, device=args.device)
    for p in lm.model.parameters():
        p.requires_grad_(False)
    reg = fit_regenerator(lm, args.calibration_contracts, layer_group=args.layer_group,
                          layer_weights=shipped_for(lm.fingerprints.base))     # as kite upcycle train fits them
    settings = CompressSettings(codec=codec_settings(args.ratio), n_clusters=8)
    print(f"regenerator fitted ({clock() - t0:.0f} s)", file=sys.stderr, flush=True)

    texts = [(f"contract {r['id']}", r["text"]) for r in
             generate_contracts(args.train_contracts, tokens=2048 + args.train_continuation + 200, seed=TRAIN_SEED)]
    texts += [(n, (LICENSES / n).read_text()) for n in CALIBRATION_LICENSES]
    held_texts = held_out_docs(args.held_out_contracts)
    train = []
    for name, text in texts:
        ids, _ = tokenize_document(lm.tokenizer, text)
        if len(ids) >= 2048 + args.train_continuation:
            train.append(Sample(lm, name, ids, 2048, args.train_continuation, settings, reg))
    for name, ctx, cont in text_windows(lm, args, held_texts.values()):
        train.append(Sample(lm, name, ctx + cont, len(ctx), len(cont), settings, reg))
    held = []
    for name, text in held_texts.items():
        ids, _ = tokenize_document(lm.tokenizer, text)
        held.append(Sample(lm, name, ids, context_tokens(len(ids)), CONTINUATION, settings, reg))
    print(f"{len(train)} training and {len(held)} held-out states ({clock() - t0:.0f} s)", file=sys.stderr, flush=True)
    with torch.no_grad():
        start_kl = sum(float(s.kl(lm, None)) for s in train) / len(train)

    res = Result("restore_tokens", device=str(lm.device))
    trained = {}
    for form in args.forms:
        rec, log, seconds = train_form(lm, form, train, args)
        trained[form] = {"train_kl_by_epoch": log, "train_seconds": round(seconds, 1),
                         "parameters": sum(p.numel() for p in rec.parameters()), "recovery": rec}
    deltas = {label: [] for label in ("plain", *args.forms)}
    with torch.no_grad():
        for s in held:
            at = f"{s.name} {args.ratio:g}x"
            for label in deltas:
                m = compare_logits(s.full, s.logits(lm, trained[label]["recovery"] if label != "plain" else None),
                                   s.targets)
                if label == "plain":
                    res.row(f"{at} full context: PPL", round(m["ppl_full"], 4), "PPL", context_tokens=len(s.ctx))
                deltas[label].append(m["ppl_other"] - m["ppl_full"])
                res.row(f"{at} {label}: PPL delta", round(deltas[label][-1], 4), "ppl", kl=round(m["kl_mean"], 5),
                        top1=round(m["top1"], 4), compression_ratio=round(s.ratio, 3))
            print(f"{at}: " + ", ".join(f"{k} {d[-1]:+.4f}" for k, d in deltas.items()), file=sys.stderr, flush=True)
    mean = {label: sum(d) / len(d) for label, d in deltas.items()}
    plain = f"mean of {len(held)} held-out documents, {args.ratio:g}x: PPL delta, the state alone"
    res.row(plain, round(mean["plain"], 4), "ppl", largest=round(max(deltas["plain"]), 4))
    for form in args.forms:
        res.row(f"mean of {len(held)} held-out documents, {args.ratio:g}x: PPL delta, {form}", round(mean[form], 4),
                "ppl", baseline=plain, largest=round(max(deltas[form]), 4),
                recovery=round(1 - mean[form] / mean["plain"], 4) if mean["plain"] > 0 else None)
        trained[form].pop("recovery")
    res.raw.update({"train_documents": [s.name for s in train], "held_out": [s.name for s in held],
                    "train_kl_before": round(start_kl, 5), "forms": trained, "seconds": round(clock() - t0, 1),
                    "regenerator": {"fingerprint": reg.fingerprint, "layer_group": args.layer_group,
                                    "weights": reg.meta.get("weights"), "layer_weights": reg.meta.get("layer_weights")}})
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
