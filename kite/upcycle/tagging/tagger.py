"""The clause tagger: a fitted head over the model's hidden states (or a prompt scorer) that
names the clause type of texts, spans and queries; stored as JSON (`to_dict` / `from_dict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kite.errors import BadInput
from kite.upcycle.tagging.fit import (
    RIDGE_LAMBDAS,
    candidate_layers,
    check_examples,
    choose_trial,
    cv_scores,
    fit_head,
    query_candidate_layers,
    score_trial,
    stratified_folds,
    zscore,
    zscore_params,
)
from kite.upcycle.tagging.hidden import (
    mean_hidden_states,
    mean_hidden_states_in_context,
    num_layers,
)
from kite.upcycle.tagging.prompt import PromptScorer

FORMAT = "kite-tagger/1"
EMBEDDING_METHODS = ("ridge", "centroid")
PROMPT_MIN_PARAMS = 1_000_000_000


def linear_scores(E: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, weights: torch.Tensor,
                  bias: torch.Tensor) -> torch.Tensor:
    """A fitted head's scores ``zscore(E) @ weights + bias`` [n, C] in float32, on ``E``'s device: a
    query pooled on a GPU is scored there (its few scores come back, not its embedding), so a GPU
    server's request path never wakes the CPU's BLAS threads for a product of a few rows (on a
    many-core host their spinning held YOCO's pass at two to five times its time)."""
    E = E.detach().float()
    mean, scale, weights, bias = (t.to(E.device) for t in (mean, scale, weights, bias))
    return zscore(E, mean, scale) @ weights + bias


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
        labels_sorted, data = check_examples(examples, labels)
        methods = list(methods) if methods else _default_methods(model)
        bad = [m for m in methods if m not in (*EMBEDDING_METHODS, "prompt")]
        if bad:
            raise BadInput(f"tagging method {bad[0]!r}: expected ridge, centroid or prompt")
        y = torch.tensor([labels_sorted.index(lab) for _, lab in data])
        n_layers = num_layers(model)
        cand_layers = sorted(set(layers)) if layers else candidate_layers(n_layers)
        if any(not 0 <= h < n_layers for h in cand_layers):
            raise BadInput(f"tagging layers {cand_layers}: hidden-state indices must be 0-"
                           f"{n_layers - 1} (the last layer's output is not used)")
        per_label = torch.bincount(y, minlength=len(labels_sorted))
        k = int(min(folds, per_label.min().item()))
        emb_methods = [m for m in methods if m in EMBEDDING_METHODS]
        fold_of = stratified_folds(y, k) if k >= 2 else None
        if fold_of is None:  # nothing to validate on: the measured best shallow layer (1)
            cand_layers = cand_layers[:1]
        feats: dict[int, torch.Tensor] = {}
        if emb_methods:
            # Two views of every example: the text run alone, and the text pooled from inside a
            # pseudo-document of other examples (as spans are pooled from a real document's
            # prefill). The head trains on both; cross-validation scores both.
            texts = [t for t, _ in data]
            alone = mean_hidden_states(model, tokenizer, texts, cand_layers, batch_size)
            inside = mean_hidden_states_in_context(model, tokenizer, texts, y.tolist(),
                                                   cand_layers)
            feats = {h: torch.cat([alone[h], inside[h]]) for h in cand_layers}

        trials: list[dict[str, Any]] = []
        if fold_of is not None:
            for h in cand_layers if emb_methods else []:
                for m in emb_methods:
                    for lam in (RIDGE_LAMBDAS if m == "ridge" else (0.0,)):
                        scores = cv_scores(feats[h], y.repeat(2), fold_of * 2, m, lam,
                                            len(labels_sorted))
                        trials.append(score_trial(m, [h], lam, scores, y.repeat(2)))
            if "prompt" in methods:
                p = PromptScorer(model, tokenizer, labels_sorted, label_names)
                scores = torch.full((len(data), len(labels_sorted)), float("nan"))
                for f in range(k):
                    train = [data[i] for i in range(len(data)) if fold_of[i] != f]
                    p.set_shots(train)
                    idx = [i for i in range(len(data)) if fold_of[i] == f]
                    scores[idx] = p.score([data[i][0] for i in idx])
                trials.append(score_trial("prompt", [], 0.0, scores, y))
        if trials:
            best = choose_trial(trials)
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
            p = PromptScorer(model, tokenizer, labels_sorted, label_names)
            p.set_shots(data)
            tagger.prompt = p.to_dict()
        else:
            tagger._set_head(feats[lay[0]], y.repeat(2), method, lam)
        return tagger

    def _set_head(self, X: torch.Tensor, y: torch.Tensor, method: str, lam: float) -> None:
        self.mean, self.scale = zscore_params(X)
        self.weights, self.bias = fit_head(zscore(X, self.mean, self.scale), y, method, lam,
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
        n_layers = num_layers(model)
        cand = sorted(set(layers)) if layers else query_candidate_layers(n_layers)
        feats = mean_hidden_states(model, tokenizer, texts, cand, batch_size)
        trials = []
        for h in cand:
            for lam in RIDGE_LAMBDAS:
                scores = cv_scores(feats[h], y, fold_of, "ridge", lam, C + 1)
                trials.append(score_trial("ridge", [h], lam, scores, y))
        best = min(trials, key=lambda t: (t["nll"], t["layers"][0], t["lam"]))
        h = best["layers"][0]
        mean, scale = zscore_params(feats[h])
        W, b = fit_head(zscore(feats[h], mean, scale), y, "ridge", best["lam"], C + 1)
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
        scores = linear_scores(E, head.mean, head.scale, head.weights, head.bias)
        raw = torch.softmax(scores / head.temperature, dim=-1).cpu()
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
        feats = mean_hidden_states(model, tokenizer, list(texts), self.query_head.layers,
                                   batch_size)
        return self.predict_queries(torch.cat([feats[h] for h in self.query_head.layers], -1))

    # ------------------------------------------------------------------ embedding and predicting

    def embed_texts(self, model, tokenizer, texts: Sequence[str],
                    batch_size: int = 8) -> torch.Tensor:
        """Mean hidden states of each text at `embedding_layers`, concatenated: [n, D·layers]."""
        if self.method == "prompt":
            raise _no_embedding_head()
        feats = mean_hidden_states(model, tokenizer, list(texts), self.embedding_layers,
                                   batch_size)
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
        return self._results(linear_scores(E, self.mean, self.scale, self.weights, self.bias).cpu())

    def tag_texts(self, model, tokenizer, texts: Sequence[str],
                  batch_size: int = 8) -> list[TagResult]:
        """Tag standalone texts with whichever method was chosen."""
        if not texts:
            return []
        if self.method == "prompt":
            p = PromptScorer.from_dict(model, tokenizer, self.labels, self.prompt)
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


def _default_methods(model) -> list[str]:
    n = sum(p.numel() for p in model.parameters())
    return [*EMBEDDING_METHODS, "prompt"] if n >= PROMPT_MIN_PARAMS else list(EMBEDDING_METHODS)
