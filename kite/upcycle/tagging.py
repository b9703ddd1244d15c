"""Semantic tagging: name each span's (or cluster's) clause type from a few labeled examples.

Two families of methods, one chosen by cross-validation on the labeled examples:

- **Hidden-state classifiers** (`ridge`, `centroid`): a text's embedding is the mean of the model's
  own hidden states over its tokens at one layer (index `h` = output of decoder layer `h`; 0 is
  the token embeddings), z-scored with the examples' mean and spread (a few "massive activation"
  dimensions otherwise swamp every distance). `ridge` is a one-vs-rest ridge regression in dual
  form; `centroid` is cosine similarity to each label's mean. Measured on SmolLM2-135M and
  generated contracts, ridge is ≥ 96% accurate from 2 examples per label at layers 2-10, where
  cosine to raw centroids is 20-90% (docs in `evaluate_tagging`).
- **Calibrated prompt scoring** (`prompt`): a few-shot prompt ("Clause: …\\nType: <label>"), each
  label's log-probability minus its log-probability after a content-free input (contextual
  calibration). Worth it on capable models; on the 135M model it is near chance, so by default
  it is a candidate only for models of ≥ 1B parameters (`methods=` overrides).

Confidences are a temperature-scaled softmax of the chosen method's scores, the temperature fitted
on the out-of-fold scores. Labels and examples are sorted before anything is computed, so the
order of the labels list (or of the examples) never changes a prediction.

`ClauseTagger.embedding_layers` says which hidden states the classifier reads, so the compress
pipeline can pool spans from the document's own prefill (`pool_spans`) instead of re-embedding
span texts. Deeper layers mix in the surrounding document, so `fit` embeds every example twice,
alone and from inside a pseudo-document of other examples, trains on both views and scores both
in cross-validation. Both uses are measured by `evaluate_tagging(..., mode="both")`; on the
embedded model they are equally accurate (docs/tagging.md).

**Queries** are not clauses: a head fitted and temperature-calibrated on clause texts is confident
about any question, off-topic ones included. `fit_queries` adds a `QueryHead`: a ridge head with
one more class, "no clause type", fitted on labeled *questions* (kite.data.traffic
`calibration_queries`), its layer, λ and temperature chosen by cross-validation that keeps each
phrasing's variants in one fold. `predict_queries` spreads the "no clause" probability evenly
over the clause labels, so a vague or off-topic question has a high label entropy and no label.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kite.errors import BadInput
from kite.runtime.batch import right_padded
from kite.runtime.generate import _cache_kwarg

FORMAT = "kite-tagger/1"
EMBEDDING_METHODS = ("ridge", "centroid")
RIDGE_LAMBDAS = (0.03, 0.3, 3.0)
PROMPT_MIN_PARAMS = 1_000_000_000
NLL_SLACK = 0.05  # nats: log-loss differences smaller than this do not pay for deeper layers
MAX_TEXT_TOKENS = 256  # a clause is 40-150 tokens; longer texts are cut (embedding cost)
_LAYER_FRACTIONS = (0.0, 0.07, 0.14, 0.2, 0.27, 0.34, 0.45, 0.6, 0.8)
_METHOD_PREFERENCE = {"ridge": 0, "centroid": 1, "prompt": 2}  # on ties: the measured better


@dataclass(frozen=True, slots=True)
class TagResult:
    """One prediction: the label, its calibrated probability, and every label's probability."""

    label: str
    confidence: float
    probs: dict[str, float]


@dataclass(slots=True)
class QueryHead:
    """The query side of a tagger: classes = the tagger's labels + "no clause type" (last)."""

    layers: list[int]  # hidden-state indices pooled over the query's tokens
    temperature: float
    lam: float
    mean: torch.Tensor  # [D]
    scale: torch.Tensor  # [D]
    weights: torch.Tensor  # [D, C + 1]
    bias: torch.Tensor  # [C + 1]
    validation: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "temperature": self.temperature, "lam": self.lam,
                "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "weights": self.weights.tolist(), "bias": self.bias.tolist(),
                "validation": self.validation}

    @classmethod
    def from_dict(cls, d: dict[str, Any], n_labels: int) -> QueryHead:
        def t(x):
            return torch.tensor(x, dtype=torch.float32)
        head = cls(layers=[int(h) for h in d["layers"]], temperature=float(d["temperature"]),
                   lam=float(d["lam"]), mean=t(d["mean"]), scale=t(d["scale"]),
                   weights=t(d["weights"]), bias=t(d["bias"]),
                   validation=d.get("validation", {}))
        if tuple(head.weights.shape) != (head.mean.shape[0], n_labels + 1):
            raise BadInput("tagger: the query head does not match the labels and embedding size")
        return head


@dataclass(slots=True)
class ClauseTagger:
    """A fitted tagger. Build it with `ClauseTagger.fit`; store it with `to_dict`/`from_dict`."""

    labels: list[str]  # sorted
    method: str  # "ridge" | "centroid" | "prompt"
    embedding_layers: list[int]  # hidden-state indices pooled (empty for "prompt")
    temperature: float
    mean: torch.Tensor | None = None  # [D] z-score centre
    scale: torch.Tensor | None = None  # [D] z-score spread
    weights: torch.Tensor | None = None  # [D, C]: ridge weights or unit centroids
    bias: torch.Tensor | None = None  # [C]
    prompt: dict[str, Any] | None = None  # prompt method: shots, label names, content-free scores
    validation: dict[str, Any] = field(default_factory=dict)
    query_head: QueryHead | None = None  # fitted on questions (fit_queries); None: clause head

    # ------------------------------------------------------------------ fitting

    @classmethod
    def fit(cls, model, tokenizer, examples: Sequence[tuple[str, str]],
            labels: Sequence[str] | None = None, *, methods: Sequence[str] | None = None,
            layers: Sequence[int] | None = None, label_names: dict[str, str] | None = None,
            folds: int = 5, batch_size: int = 8) -> ClauseTagger:
        """Fit on `(text, label)` examples; choose method and layer by cross-validation.

        `labels` (any order) restricts/declares the label set; every label needs ≥ 1 example,
        and cross-validation needs ≥ 2 per label (with 1, ridge on the first candidate layer
        is used unvalidated). `methods` defaults to ridge and centroid, plus prompt on models of
        ≥ 1B parameters. `label_names` gives the prompt method a readable name per label id.
        Raises BadInput on unknown labels, empty texts, or a label without examples.
        """
        labels_sorted, data = _check_examples(examples, labels)
        methods = list(methods) if methods else _default_methods(model)
        bad = [m for m in methods if m not in (*EMBEDDING_METHODS, "prompt")]
        if bad:
            raise BadInput(f"tagging method {bad[0]!r}: expected ridge, centroid or prompt")
        y = torch.tensor([labels_sorted.index(lab) for _, lab in data])
        n_layers = _num_layers(model)
        cand_layers = sorted(set(layers)) if layers else candidate_layers(n_layers)
        if any(not 0 <= h < n_layers for h in cand_layers):
            raise BadInput(f"tagging layers {cand_layers}: hidden-state indices must be 0-"
                           f"{n_layers - 1} (the last layer's output is not used)")
        per_label = torch.bincount(y, minlength=len(labels_sorted))
        k = int(min(folds, per_label.min().item()))
        emb_methods = [m for m in methods if m in EMBEDDING_METHODS]
        fold_of = _stratified_folds(y, k) if k >= 2 else None
        if fold_of is None:  # nothing to validate on: the measured best shallow layer (1)
            cand_layers = cand_layers[:1]
        feats: dict[int, torch.Tensor] = {}
        if emb_methods:
            # Two views of every example: the text run alone, and the text pooled from inside a
            # pseudo-document of other examples (as spans are pooled from a real document's
            # prefill). The head trains on both; cross-validation scores both.
            texts = [t for t, _ in data]
            alone = _embed_layers(model, tokenizer, texts, cand_layers, batch_size)
            inside = _embed_in_context(model, tokenizer, texts, y.tolist(), cand_layers)
            feats = {h: torch.cat([alone[h], inside[h]]) for h in cand_layers}

        trials: list[dict[str, Any]] = []
        if fold_of is not None:
            for h in cand_layers if emb_methods else []:
                for m in emb_methods:
                    for lam in (RIDGE_LAMBDAS if m == "ridge" else (0.0,)):
                        scores = _cv_scores(feats[h], y.repeat(2), fold_of * 2, m, lam,
                                            len(labels_sorted))
                        trials.append(_trial(m, [h], lam, scores, y.repeat(2)))
            if "prompt" in methods:
                p = _PromptScorer(model, tokenizer, labels_sorted, label_names)
                scores = torch.full((len(data), len(labels_sorted)), float("nan"))
                for f in range(k):
                    train = [data[i] for i in range(len(data)) if fold_of[i] != f]
                    p.set_shots(train)
                    idx = [i for i in range(len(data)) if fold_of[i] == f]
                    scores[idx] = p.score([data[i][0] for i in idx])
                trials.append(_trial("prompt", [], 0.0, scores, y))
        if trials:
            best = _choose(trials)
            validation = {"folds": k, "examples": len(data), "accuracy": best["accuracy"],
                          "nll": best["nll"], "trials": [
                              {key: t[key] for key in ("method", "layers", "lam", "accuracy",
                                                       "nll")}
                              for t in trials]}
            method, lay = best["method"], best["layers"]
            lam, temp = best["lam"], best["temperature"]
        else:  # one example of some label: nothing to validate on
            method = "ridge" if "ridge" in emb_methods else (emb_methods or ["prompt"])[0]
            lay = [] if method == "prompt" else cand_layers[:1]
            lam, temp = RIDGE_LAMBDAS[1], 0.1 if method == "ridge" else 1.0
            validation = {"folds": 0, "examples": len(data), "accuracy": None, "nll": None,
                          "note": "fewer than 2 examples of some label: not validated"}
        validation["lam"] = lam
        tagger = cls(labels=labels_sorted, method=method, embedding_layers=lay,
                     temperature=float(temp), validation=validation)
        if method == "prompt":
            p = _PromptScorer(model, tokenizer, labels_sorted, label_names)
            p.set_shots(data)
            tagger.prompt = p.to_dict()
        else:
            tagger._fit_head(feats[lay[0]], y.repeat(2), method, lam)
        return tagger

    def _fit_head(self, X: torch.Tensor, y: torch.Tensor, method: str, lam: float) -> None:
        self.mean, self.scale = _zscore_params(X)
        self.weights, self.bias = _fit_head(_zscore(X, self.mean, self.scale), y, method, lam,
                                            len(self.labels))

    # ------------------------------------------------------------------ the query side

    def fit_queries(self, model, tokenizer, queries: Sequence[tuple[str, str | None, str]], *,
                    layers: Sequence[int] | None = None, folds: int = 5,
                    batch_size: int = 32) -> QueryHead:
        """Fit the query head on `(text, label or None, group)` questions; returns it (also set
        as `self.query_head`). Label None = about no single clause type (off-topic, the whole
        contract, a planted code). Layer and λ: the lowest out-of-fold log-loss after fitting
        the temperature, folds by `group` (a phrasing's variants never straddle folds).
        Repeated texts count once."""
        seen: dict[str, tuple[str | None, str]] = {}
        for k, q in enumerate(queries):
            if not (isinstance(q, (tuple, list)) and len(q) == 3 and isinstance(q[0], str)
                    and q[0].strip()):
                raise BadInput(f"query example {k}: expected (text, label or None, group)")
            if q[1] is not None and q[1] not in self.labels:
                raise BadInput(f"query example {k}: label {q[1]!r} is not among the tagger's "
                               f"labels ({', '.join(self.labels)})")
            seen.setdefault(q[0], (q[1], str(q[2])))
        texts = sorted(seen)
        C = len(self.labels)
        y = torch.tensor([C if seen[t][0] is None else self.labels.index(seen[t][0])
                          for t in texts])
        groups = sorted({seen[t][1] for t in texts},
                        key=lambda g: (min(int(y[i]) for i, t in enumerate(texts)
                                           if seen[t][1] == g), g))
        k = min(folds, len(groups))
        if k < 2 or len(set(y.tolist())) < 2:
            raise BadInput("query calibration needs at least 2 phrasings and 2 classes")
        fold_of_group = {g: i % k for i, g in enumerate(groups)}
        fold_of = [fold_of_group[seen[t][1]] for t in texts]
        n_layers = _num_layers(model)
        cand = sorted(set(layers)) if layers else query_candidate_layers(n_layers)
        feats = _embed_layers(model, tokenizer, texts, cand, batch_size)
        trials = []
        for h in cand:
            for lam in RIDGE_LAMBDAS:
                scores = _cv_scores(feats[h], y, fold_of, "ridge", lam, C + 1)
                trials.append(_trial("ridge", [h], lam, scores, y))
        best = min(trials, key=lambda t: (t["nll"], t["layers"][0], t["lam"]))
        h = best["layers"][0]
        mean, scale = _zscore_params(feats[h])
        W, b = _fit_head(_zscore(feats[h], mean, scale), y, "ridge", best["lam"], C + 1)
        counts = {lab: int((y == i).sum()) for i, lab in enumerate([*self.labels, ""])}
        self.query_head = QueryHead(
            layers=[h], temperature=float(best["temperature"]), lam=best["lam"], mean=mean,
            scale=scale, weights=W, bias=b,
            validation={"folds": k, "queries": len(texts), "phrasings": len(groups),
                        "per_class": counts, "accuracy": best["accuracy"], "nll": best["nll"],
                        "trials": [{key: t[key] for key in ("layers", "lam", "accuracy", "nll")}
                                   for t in trials]})
        return self.query_head

    @property
    def query_layers(self) -> list[int]:
        """Hidden-state indices a query's embedding pools (the query head's, else the clause
        head's; empty for a prompt-scoring tagger without a query head)."""
        if self.query_head is not None:
            return list(self.query_head.layers)
        return list(self.embedding_layers)

    def predict_queries(self, E: torch.Tensor) -> list[TagResult]:
        """Labels of queries from their pooled embeddings at `query_layers`.

        With a query head: probabilities over the C labels + "no clause"; the "no clause" mass is
        spread evenly over the labels in `probs` (a question about no clause is about any of
        them), and `label` is "" when "no clause" is the most likely class. Without one (a tagger
        saved before query calibration): the clause head, as before.
        """
        head = self.query_head
        if head is None:
            return self.predict_embeddings(E)
        E = E.detach().float().cpu()
        scores = _zscore(E, head.mean, head.scale) @ head.weights + head.bias
        raw = torch.softmax(scores / head.temperature, dim=-1)
        C = len(self.labels)
        out = []
        for row in raw:
            spread = row[:C] + row[C] / C
            i = int(row.argmax())
            label = self.labels[i] if i < C else ""
            out.append(TagResult(label, float(row[i]),
                                 {lab: float(p) for lab, p in zip(self.labels, spread)}))
        return out

    def tag_queries(self, model, tokenizer, texts: Sequence[str],
                    batch_size: int = 32) -> list[TagResult]:
        """Tag standalone queries (the query head when there is one)."""
        if not texts:
            return []
        if self.query_head is None:
            return self.tag_texts(model, tokenizer, texts, batch_size)
        feats = _embed_layers(model, tokenizer, list(texts), self.query_head.layers, batch_size)
        return self.predict_queries(torch.cat([feats[h] for h in self.query_head.layers], -1))

    # ------------------------------------------------------------------ embedding and predicting

    def embed_texts(self, model, tokenizer, texts: Sequence[str],
                    batch_size: int = 8) -> torch.Tensor:
        """Mean hidden states of each text at `embedding_layers`, concatenated: [n, D·layers]."""
        if self.method == "prompt":
            raise _no_embedding_head()
        feats = _embed_layers(model, tokenizer, list(texts), self.embedding_layers, batch_size)
        return torch.cat([feats[h] for h in self.embedding_layers], dim=-1)

    def pool_spans(self, hidden_states_per_layer,
                   token_spans: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Embeddings of spans of an already-run document: [n_spans, D·layers].

        `hidden_states_per_layer`: HF's `hidden_states` tuple (index = hidden-state index) or a
        dict {index: tensor}; each tensor [T, D] or [1, T, D]. `token_spans`: (start, end) token
        indices, end exclusive. Same pooling as `embed_texts`, so `predict_embeddings` applies.
        """
        out = []
        for start, end in token_spans:
            if not 0 <= start < end:
                raise BadInput(f"token span ({start}, {end}) is empty or negative")
            parts = []
            for h in self.embedding_layers:
                hs = hidden_states_per_layer[h]
                hs = hs[0] if hs.dim() == 3 else hs
                if end > hs.shape[0]:
                    raise BadInput(f"token span ({start}, {end}) is past the {hs.shape[0]} tokens")
                parts.append(hs[start:end].float().mean(0))
            out.append(torch.cat(parts))
        return torch.stack(out) if out else torch.zeros(0, self._dim())

    def predict_embeddings(self, E: torch.Tensor) -> list[TagResult]:
        """Label, calibrated confidence and per-label probabilities for each row of `E`."""
        if self.method == "prompt":
            raise _no_embedding_head()
        E = E.detach().float().cpu()  # pooled from a GPU prefill, perhaps in bf16
        scores = _zscore(E, self.mean, self.scale) @ self.weights + self.bias
        return self._results(scores)

    def tag_texts(self, model, tokenizer, texts: Sequence[str],
                  batch_size: int = 8) -> list[TagResult]:
        """Tag standalone texts with whichever method was chosen."""
        if not texts:
            return []
        if self.method == "prompt":
            p = _PromptScorer.from_dict(model, tokenizer, self.labels, self.prompt)
            return self._results(p.score(list(texts)))
        return self.predict_embeddings(self.embed_texts(model, tokenizer, texts, batch_size))

    def _results(self, scores: torch.Tensor) -> list[TagResult]:
        probs = torch.softmax(scores / self.temperature, dim=-1)
        out = []
        for row in probs:
            i = int(row.argmax())  # ties go to the first label in sorted order
            out.append(TagResult(self.labels[i], float(row[i]),
                                 {lab: float(p) for lab, p in zip(self.labels, row)}))
        return out

    def _dim(self) -> int:
        return 0 if self.mean is None else int(self.mean.shape[0])

    # ------------------------------------------------------------------ storage

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (lists of floats, no pickle); `from_dict` restores an identical tagger."""
        def t(x):
            return None if x is None else x.tolist()
        return {"format": FORMAT, "labels": self.labels, "method": self.method,
                "embedding_layers": self.embedding_layers, "temperature": self.temperature,
                "mean": t(self.mean), "scale": t(self.scale), "weights": t(self.weights),
                "bias": t(self.bias), "prompt": self.prompt, "validation": self.validation,
                "query_head": self.query_head.to_dict() if self.query_head else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClauseTagger:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise BadInput(f"tagger: expected format {FORMAT!r}, got "
                           f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r}")
        try:
            def t(x):
                return None if x is None else torch.tensor(x, dtype=torch.float32)
            tagger = cls(labels=list(d["labels"]), method=d["method"],
                         embedding_layers=[int(h) for h in d["embedding_layers"]],
                         temperature=float(d["temperature"]), mean=t(d["mean"]),
                         scale=t(d["scale"]), weights=t(d["weights"]), bias=t(d["bias"]),
                         prompt=d.get("prompt"), validation=d.get("validation", {}))
            if d.get("query_head") is not None:  # absent from taggers saved before it existed
                tagger.query_head = QueryHead.from_dict(d["query_head"], len(tagger.labels))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInput(f"tagger: malformed ({type(exc).__name__}: {exc})") from None
        shape = None if tagger.weights is None else tuple(tagger.weights.shape)
        if tagger.method != "prompt" and shape != (tagger._dim(), len(tagger.labels)):
            raise BadInput("tagger: weights do not match the labels and embedding size")
        return tagger


def _no_embedding_head() -> BadInput:
    return BadInput("this tagger scores prompts; it has no embedding head (use tag_texts)")


# ---------------------------------------------------------------------- helpers


def candidate_layers(n_layers: int) -> list[int]:
    """Hidden-state indices tried by `fit`: layer 1 and a spread over the first 80% of the depth.

    On SmolLM2-135M the output of the first decoder layer is already the best (and by far the
    cheapest) for clause types, standalone and pooled in-document alike.
    """
    if n_layers <= 1:
        return [0]
    return sorted({min(n_layers - 1, max(1, round(f * n_layers))) for f in _LAYER_FRACTIONS})


def query_candidate_layers(n_layers: int) -> list[int]:
    """Hidden-state indices `fit_queries` tries: the clause candidates plus deeper ones (a vague
    question names no clause word; its type, if any, is in the later layers)."""
    if n_layers <= 1:
        return [0]
    deep = {min(n_layers - 1, round(f * n_layers)) for f in (0.9, 1.0)}
    return sorted(set(candidate_layers(n_layers)) | deep)


def _check_examples(examples, labels) -> tuple[list[str], list[tuple[str, str]]]:
    data = []
    for k, ex in enumerate(examples):
        if not (isinstance(ex, (tuple, list)) and len(ex) == 2 and isinstance(ex[0], str)
                and isinstance(ex[1], str)):
            raise BadInput(f"tagging example {k}: expected a (text, label) pair of strings")
        if not ex[0].strip():
            raise BadInput(f"tagging example {k} ({ex[1]}): the text is empty")
        data.append((ex[0], ex[1]))
    seen = sorted({lab for _, lab in data})
    if labels is None:
        labels_sorted = seen
    else:
        labels_sorted = sorted(set(labels))
        unknown = [lab for lab in seen if lab not in labels_sorted]
        if unknown:
            raise BadInput(f"tagging examples use label {unknown[0]!r}, which is not among the "
                           f"labels ({', '.join(labels_sorted)})")
    missing = [lab for lab in labels_sorted if lab not in seen]
    if missing:
        raise BadInput(f"tagging: label {missing[0]!r} has no example (need at least 1 per label)")
    if len(labels_sorted) < 2:
        raise BadInput("tagging needs at least 2 labels")
    # Sorting makes everything downstream independent of the order examples were given in.
    return labels_sorted, sorted(data, key=lambda e: (e[1], e[0]))


def _default_methods(model) -> list[str]:
    n = sum(p.numel() for p in model.parameters())
    return [*EMBEDDING_METHODS, "prompt"] if n >= PROMPT_MIN_PARAMS else list(EMBEDDING_METHODS)


def _decoder_layers(model):
    for path in ("model.layers", "base_model.model.model.layers", "model.model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    return None


def _num_layers(model) -> int:
    layers = _decoder_layers(model)
    return len(layers) if layers is not None else int(model.config.num_hidden_layers)


class _Stop(Exception):
    pass


@torch.no_grad()
def hidden_states_at(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     wanted: Sequence[int]) -> dict[int, torch.Tensor]:
    """Hidden states {index: [B, T, D]} at `wanted` indices, running only the layers needed.

    Index 0 is the embedding output, `h` the output of decoder layer `h` (before the final norm).
    """
    wanted = sorted(set(wanted))
    layers = _decoder_layers(model)
    got: dict[int, torch.Tensor] = {}
    hooks = []
    if layers is None:  # unknown layout: run everything
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                    use_cache=False)
        return {h: out.hidden_states[h] for h in wanted}
    last = wanted[-1]

    def grab(h):
        def hook(_mod, args, output):
            hs = output[0] if isinstance(output, tuple) else output
            got[h] = hs.float()
            if h == last:
                raise _Stop
        return hook

    if 0 in wanted:
        emb = model.get_input_embeddings()
        hooks.append(emb.register_forward_hook(grab(0)))
    for h in wanted:
        if h > 0:
            hooks.append(layers[h - 1].register_forward_hook(grab(h)))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _Stop:
        pass
    finally:
        for hk in hooks:
            hk.remove()
    return got


def _embed_layers(model, tokenizer, texts: list[str], layers: Sequence[int],
                  batch_size: int) -> dict[int, torch.Tensor]:
    """Mean-pooled hidden states {layer: [n, D]} of standalone texts (batched, right-padded)."""
    device = next(model.parameters()).device
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:MAX_TEXT_TOKENS] for t in texts]
    for k, seq in enumerate(ids):
        if not seq:
            raise BadInput(f"tagging text {k} has no tokens")
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch together
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = {h: torch.zeros(len(ids), _hidden_size(model)) for h in layers}
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        inp, mask = right_padded([ids[i] for i in idx], pad)
        hs = hidden_states_at(model, inp.to(device), mask.to(device), layers)
        m = mask.to(device)[..., None].float()
        for h in layers:
            out[h][idx] = ((hs[h] * m).sum(1) / m.sum(1)).cpu()
    return out


def _embed_in_context(model, tokenizer, texts: list[str], labels: list[int],
                      layers: Sequence[int], per_doc: int = 8) -> dict[int, torch.Tensor]:
    """Mean hidden states of each text pooled from inside a pseudo-document of `per_doc` texts.

    Texts are dealt round-robin by label (deterministic, from the sorted examples), so a
    pseudo-document mixes clause types like a contract; pieces are joined by a blank line.
    """
    device = next(model.parameters()).device
    by_label: dict[int, list[int]] = {}
    for i, lab in enumerate(labels):
        by_label.setdefault(lab, []).append(i)
    order: list[int] = []
    queues = [list(v) for _, v in sorted(by_label.items())]
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    out = {h: torch.zeros(len(texts), _hidden_size(model)) for h in layers}
    for b in range(0, len(order), per_doc):
        ids: list[int] = []
        spans: list[tuple[int, int, int]] = []
        for i in order[b:b + per_doc]:
            piece = tokenizer(texts[i], add_special_tokens=False)["input_ids"][:MAX_TEXT_TOKENS]
            if ids:
                ids += sep
            spans.append((i, len(ids), len(ids) + len(piece)))
            ids += piece
        hs = hidden_states_at(model, torch.tensor([ids], device=device), None, layers)
        for i, a, e in spans:
            for h in layers:
                out[h][i] = hs[h][0, a:e].mean(0).cpu()
    return out


def _hidden_size(model) -> int:
    return int(model.config.hidden_size)


def _zscore_params(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = X.mean(0)
    sd = X.std(0, unbiased=False) if len(X) > 1 else torch.ones_like(mean)
    return mean, sd + 1e-3 * sd.mean() + 1e-8  # floor: a dimension constant in the examples


def _zscore(X, mean, scale):
    return (X - mean) / scale


def _fit_head(A: torch.Tensor, y: torch.Tensor, method: str, lam: float,
              n_labels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [D, C] and bias [C] on z-scored features `A` [n, D]."""
    if method == "centroid":
        An = torch.nn.functional.normalize(A, dim=-1)
        C = torch.stack([An[y == c].mean(0) for c in range(n_labels)])
        return torch.nn.functional.normalize(C, dim=-1).T.contiguous(), torch.zeros(n_labels)
    # Ridge in dual form (n examples << D dims); kernel scaled by 1/D so lam is size-free.
    A64 = A.double()
    D = A.shape[1]
    Y = torch.nn.functional.one_hot(y, n_labels).double()
    ybar = Y.mean(0)
    K = A64 @ A64.T / D
    alpha = torch.linalg.solve(K + lam * torch.eye(len(A), dtype=torch.float64), Y - ybar)
    W = (A64.T @ alpha) / D
    return W.float(), ybar.float()


def _stratified_folds(y: torch.Tensor, k: int) -> list[int]:
    """Fold of each example: the i-th example of each label goes to fold i mod k."""
    seen: dict[int, int] = {}
    folds = []
    for lab in y.tolist():
        folds.append(seen.get(lab, 0) % k)
        seen[lab] = seen.get(lab, 0) + 1
    return folds


def _cv_scores(X, y, fold_of, method, lam, n_labels) -> torch.Tensor:
    scores = torch.zeros(len(y), n_labels)
    folds = torch.tensor(fold_of)
    for f in sorted(set(fold_of)):
        tr, te = folds != f, folds == f
        mean, scale = _zscore_params(X[tr])
        W, b = _fit_head(_zscore(X[tr], mean, scale), y[tr], method, lam, n_labels)
        scores[te] = _zscore(X[te], mean, scale) @ W + b
    return scores


def fit_temperature(scores: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The softmax temperature minimizing the mean negative log-likelihood; (T, nll).

    The targets are smoothed by 1/(n+2) (Laplace): with every out-of-fold prediction right, the
    plain minimum is at T → 0 and every confidence would read 1.0 however few examples there were.
    """
    eps = 1.0 / (len(y) + 2)
    best = (1.0, math.inf)
    for T in torch.logspace(-3, 2, 61).tolist():
        nll = torch.nn.functional.cross_entropy(scores / T, y, label_smoothing=eps).item()
        if nll < best[1]:
            best = (T, nll)
    return best


def _choose(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Best accuracy; among those, the shallowest layer whose log-loss is within NLL_SLACK of
    the best (cheaper to run: on SmolLM2 deeper layers' small log-loss gains did not carry over
    to held-out contracts); then ridge before centroid, lower log-loss, smaller lambda."""
    top = max(t["accuracy"] for t in trials)
    tied = [t for t in trials if t["accuracy"] == top]
    floor = min(t["nll"] for t in tied)
    near = [t for t in tied if t["nll"] <= floor + NLL_SLACK]
    return min(near, key=lambda t: (t["layers"][0] if t["layers"] else 0,
                                    _METHOD_PREFERENCE[t["method"]], t["nll"], t["lam"]))


def _trial(method, layers, lam, scores, y) -> dict[str, Any]:
    acc = (scores.argmax(-1) == y).float().mean().item()
    T, nll = fit_temperature(scores, y)
    return {"method": method, "layers": layers, "lam": lam, "accuracy": round(acc, 4),
            "nll": round(nll, 4), "temperature": T}


class _PromptScorer:
    """Few-shot prompt scoring with contextual calibration (Zhao et al., 2021).

    score(text)[label] = log p(label name | shots + text) − log p(label name | shots + "N/A").
    Shots: one example per label (its shortest), in sorted label order.
    """

    TEMPLATE = "Clause: {text}\nType:"
    HEADER = "Classify each contract clause by its type ({names}).\n\n"

    def __init__(self, model, tokenizer, labels, label_names=None):
        self.model, self.tok, self.labels = model, tokenizer, labels
        self.names = {lab: (label_names or {}).get(lab, lab.replace("_", " ")) for lab in labels}
        self.shots: list[tuple[str, str]] = []
        self.content_free: torch.Tensor | None = None

    def set_shots(self, data: Sequence[tuple[str, str]]) -> None:
        self.shots = []
        for lab in self.labels:
            texts = sorted((t for t, lb in data if lb == lab), key=lambda t: (len(t), t))
            if texts:
                self.shots.append((_clip_words(texts[0], 60), lab))
        self.content_free = self._raw(["N/A"])[0]

    def _prefix(self) -> str:
        head = self.HEADER.format(names=", ".join(self.names[lab] for lab in self.labels))
        return head + "".join(self.TEMPLATE.format(text=t) + f" {self.names[lab]}\n\n"
                              for t, lab in self.shots)

    @torch.no_grad()
    def _raw(self, texts: list[str]) -> torch.Tensor:
        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        cands = [self.tok(" " + self.names[lab], add_special_tokens=False)["input_ids"]
                 for lab in self.labels]
        out = torch.zeros(len(texts), len(self.labels))
        for i, text in enumerate(texts):
            prompt = self._prefix() + self.TEMPLATE.format(text=_clip_words(text, 200))
            ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([ids], device=device)
            cache = DynamicCache(config=self.model.config)
            kw = _cache_kwarg(self.model)   # `cache` in transformers 5.2x, `past_key_values` before
            res = self.model(input_ids=ids, use_cache=True, **{kw: cache})
            first = torch.log_softmax(res.logits[0, -1].float(), -1)
            n = ids.shape[1]
            for j, cand in enumerate(cands):
                lp = first[cand[0]].item()
                if len(cand) > 1:
                    r = self.model(input_ids=torch.tensor([cand[:-1]], device=device),
                                   use_cache=True, **{kw: cache})
                    logp = torch.log_softmax(r.logits[0].float(), -1)
                    lp += sum(logp[t, cand[t + 1]].item() for t in range(len(cand) - 1))
                    _crop_to(cache, n)
                out[i, j] = lp
        return out

    def score(self, texts: list[str]) -> torch.Tensor:
        return self._raw(texts) - self.content_free

    def to_dict(self) -> dict[str, Any]:
        return {"shots": [list(s) for s in self.shots], "names": self.names,
                "content_free": self.content_free.tolist()}

    @classmethod
    def from_dict(cls, model, tokenizer, labels, d) -> _PromptScorer:
        p = cls(model, tokenizer, labels, d["names"])
        p.shots = [(t, lab) for t, lab in d["shots"]]
        p.content_free = torch.tensor(d["content_free"])
        return p


def _crop_to(cache, n: int) -> None:
    """Cut the cache back to its first `n` tokens (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)
    if cache.get_seq_length() != n:
        raise RuntimeError(f"could not crop the KV cache back to {n} tokens")


def _clip_words(text: str, n: int) -> str:
    words = text.split()
    return text if len(words) <= n else " ".join(words[:n]) + " …"
