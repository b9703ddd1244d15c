"""The classifier maths behind `ClauseTagger.fit`: examples checked, candidate layers, z-scored
features, ridge or centroid heads, stratified folds, out-of-fold scores, the softmax temperature,
and the choice among the cross-validated trials.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kite.errors import BadInput

RIDGE_LAMBDAS = (0.03, 0.3, 3.0)
NLL_SLACK = 0.05  # nats: log-loss differences smaller than this do not pay for deeper layers
_LAYER_FRACTIONS = (0.0, 0.07, 0.14, 0.2, 0.27, 0.34, 0.45, 0.6, 0.8)
_METHOD_PREFERENCE = {"ridge": 0, "centroid": 1, "prompt": 2}  # on ties: the measured better


def candidate_layers(n_layers: int) -> list[int]:
    """Hidden-state indices tried by `fit`: layer 1 and a spread over the first 80% of the depth.

    Layer 1 is always tried: a shallow layer can already name clause types, and it is by far the
    cheapest to run (measured per model in docs/tagging.md).
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


def check_examples(examples, labels) -> tuple[list[str], list[tuple[str, str]]]:
    """(sorted labels, examples sorted by label then text); BadInput on a malformed or empty
    example, a label outside `labels`, a label without examples, or fewer than 2 labels."""
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


def zscore_params(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension centre and spread [D] of features `X` [n, D] (a few "massive activation"
    dimensions otherwise swamp every distance)."""
    mean = X.mean(0)
    sd = X.std(0, unbiased=False) if len(X) > 1 else torch.ones_like(mean)
    return mean, sd + 1e-3 * sd.mean() + 1e-8  # floor: a dimension constant in the examples


def zscore(X, mean, scale):
    return (X - mean) / scale


def fit_head(A: torch.Tensor, y: torch.Tensor, method: str, lam: float,
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


def stratified_folds(y: torch.Tensor, k: int) -> list[int]:
    """Fold of each example: the i-th example of each label goes to fold i mod k."""
    seen: dict[int, int] = {}
    folds = []
    for lab in y.tolist():
        folds.append(seen.get(lab, 0) % k)
        seen[lab] = seen.get(lab, 0) + 1
    return folds


def cv_scores(X, y, fold_of, method, lam, n_labels) -> torch.Tensor:
    """Out-of-fold scores [n, n_labels]: each fold scored by a head fitted on the others."""
    scores = torch.zeros(len(y), n_labels)
    folds = torch.tensor(fold_of)
    for f in sorted(set(fold_of)):
        tr, te = folds != f, folds == f
        mean, scale = zscore_params(X[tr])
        W, b = fit_head(zscore(X[tr], mean, scale), y[tr], method, lam, n_labels)
        scores[te] = zscore(X[te], mean, scale) @ W + b
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


def choose_trial(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Best accuracy; among those, the shallowest layer whose log-loss is within NLL_SLACK of
    the best (cheaper to run, and a deeper layer's small log-loss gain in cross-validation need
    not carry over to held-out texts); then ridge before centroid, lower log-loss, smaller
    lambda."""
    top = max(t["accuracy"] for t in trials)
    tied = [t for t in trials if t["accuracy"] == top]
    floor = min(t["nll"] for t in tied)
    near = [t for t in tied if t["nll"] <= floor + NLL_SLACK]
    return min(near, key=lambda t: (t["layers"][0] if t["layers"] else 0,
                                    _METHOD_PREFERENCE[t["method"]], t["nll"], t["lam"]))


def score_trial(method, layers, lam, scores, y) -> dict[str, Any]:
    """One candidate's out-of-fold accuracy, fitted temperature and log-loss."""
    acc = (scores.argmax(-1) == y).float().mean().item()
    T, nll = fit_temperature(scores, y)
    return {"method": method, "layers": layers, "lam": lam, "accuracy": round(acc, 4),
            "nll": round(nll, 4), "temperature": T}
