"""Actions: what a matched rule asks for, checked when the rules load.

    load_cluster: LABEL | [LABEL, ...] | $query_label
    load_all_clusters: true
    skip: true                       (load nothing)
    precision: fp32|fp16|bf16|fp8|int8|int4
    layers: all | "12-18" | "1,3,5-7" | [12, 13, 14]
    enable_micro_sampling: true
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kite.yoco.signals import suggest

PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
ACTION_KEYS = ("load_cluster", "load_all_clusters", "skip", "precision", "layers",
               "enable_micro_sampling")
QUERY_LABEL = "$query_label"

LoadKind = Literal["clusters", "all", "query_label", "skip"]


@dataclass(frozen=True, slots=True)
class Action:
    """A checked action. `layers=None` means every layer; `precision=None` the state's own."""

    load: LoadKind
    clusters: tuple[str, ...] = ()
    precision: str | None = None
    layers: tuple[int, ...] | None = None
    enable_micro_sampling: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"load": self.load, "clusters": list(self.clusters), "precision": self.precision,
                "layers": None if self.layers is None else list(self.layers),
                "enable_micro_sampling": self.enable_micro_sampling}


@dataclass(frozen=True, slots=True)
class ActionProblem:
    """`where` names the YAML node: 'action', a key, or (key, item index); `offset` is a column
    offset inside a string value."""

    message: str
    where: Any
    offset: int = 0
    length: int = 1


@dataclass(frozen=True, slots=True)
class LayerRun:
    """Layers `lo`-`hi`: one piece of a `layers:` value as written. `where`, `offset` and `length`
    place it as an ActionProblem's do (a compiled rule keeps its runs placed in the file: `where`
    is then a `Span`)."""

    lo: int
    hi: int
    where: Any
    offset: int = 0
    length: int = 1


def parse_layer_spec(spec: Any, n_layers: int | None = None
                     ) -> tuple[tuple[int, ...] | None, list[ActionProblem]]:
    """`all` → None; `"12-18"`, `"1,3,5-7"`, `7` or `[12, 13]` → sorted layer numbers. With
    `n_layers`, each run that names a layer such a model lacks is a problem too."""
    runs, problems = layer_runs(spec)
    if runs is None:
        return None, problems
    return layer_numbers(runs), problems + layer_problems(runs, n_layers)


def layer_numbers(runs) -> tuple[int, ...]:
    """The sorted layer numbers a `layers:` value's runs cover."""
    return tuple(sorted({i for r in runs for i in range(r.lo, r.hi + 1)}))


def layer_runs(spec: Any) -> tuple[tuple[LayerRun, ...] | None, list[ActionProblem]]:
    """A `layers:` value as the runs it is written in (None: `all`), and what is wrong with how
    it is written. Whether a model has those layers is `layer_problems`' question."""
    problems: list[ActionProblem] = []
    runs: list[LayerRun] = []
    what = "layers: expected all, \"A-B\", a comma list like \"1,3,5-7\" or a list of numbers"
    if isinstance(spec, str) and spec.strip().lower() == "all":
        return None, problems
    if isinstance(spec, bool) or spec is None:
        return (), [ActionProblem(what, "layers")]
    if isinstance(spec, int):
        _add_run(runs, problems, LayerRun(spec, spec, "layers", 0, len(str(spec))))
    elif isinstance(spec, list):
        for i, item in enumerate(spec):
            if isinstance(item, bool) or not isinstance(item, int):
                problems.append(ActionProblem(f"layers: {item!r} is not a layer number",
                                              ("layers", i)))
            else:
                _add_run(runs, problems, LayerRun(item, item, ("layers", i), 0, len(str(item))))
    elif isinstance(spec, str):
        offset = 0
        for part in spec.split(","):
            lead = len(part) - len(part.lstrip())
            text = part.strip()
            at = offset + lead
            lo_s, dash, hi_s = text.partition("-")
            try:
                lo, hi = int(lo_s), int(hi_s) if dash else int(lo_s)
            except ValueError:
                problems.append(ActionProblem(what, "layers", at, max(1, len(text))))
            else:
                if lo > hi:
                    problems.append(ActionProblem(f"layers: range {text!r} runs backwards",
                                                  "layers", at, len(text)))
                else:
                    _add_run(runs, problems, LayerRun(lo, hi, "layers", at, len(text)))
            offset += len(part) + 1
    else:
        problems.append(ActionProblem(what, "layers"))
    if not runs and not problems:
        problems.append(ActionProblem("layers: an empty list loads into no layer; write all, or the "
                                      "layers to load", "layers"))
    return tuple(runs), problems


def _add_run(runs: list[LayerRun], problems: list[ActionProblem], run: LayerRun) -> None:
    negative = layer_problems([run], None)  # a layer below 0 is wrong for every model
    if negative:
        problems.extend(negative)
    else:
        runs.append(run)


def layer_problems(runs, n_layers: int | None) -> list[ActionProblem]:
    """One problem per run that names a layer a model of `n_layers` layers lacks (None: any count,
    so only negative layers)."""
    out = []
    for run in runs:
        message = layer_range_problem(run.lo, run.hi, n_layers)
        if message is not None:
            out.append(ActionProblem(message, run.where, run.offset, run.length))
    return out


def layer_range_problem(lo: int, hi: int, n_layers: int | None) -> str | None:
    """Why layers `lo`-`hi` do not fit a model of `n_layers` layers (None: any count), or None."""
    bad = next((i for i in (lo, hi) if i < 0 or (n_layers is not None and i >= n_layers)), None)
    if bad is None:
        return None
    top = f"0-{n_layers - 1}" if n_layers is not None else "0 and up"
    return f"layer {bad} is out of range {top}" + (f" (the model has {n_layers} layers)" if n_layers else "")


def check_action(data: Any, labels: list[str] | None
                 ) -> tuple[Action | None, list[ActionProblem], tuple[LayerRun, ...]]:
    """Check one rule's `action:` mapping; return the Action (None if it has errors), the problems
    and the runs its `layers:` names (checked against a model's layer count by the caller, once
    the count is known: a model's layers are no part of how an action is written)."""
    from kite.yoco.rules.checker import label_problem

    if not isinstance(data, dict) or not data:
        return None, [ActionProblem("action: expected a mapping such as "
                                    "`{load_cluster: LABEL, precision: int8}`", "action")], ()
    problems: list[ActionProblem] = []
    for key in data:
        if key not in ACTION_KEYS:
            hint = suggest(str(key), ACTION_KEYS)
            problems.append(ActionProblem(
                f"unknown action key {key!r}" + (f"; did you mean {hint!r}?" if hint else
                                                  "; keys: " + ", ".join(ACTION_KEYS)), key))
    loads = [k for k in ("load_cluster", "load_all_clusters", "skip") if k in data]
    kind: LoadKind = "skip"
    clusters: tuple[str, ...] = ()
    if not loads:
        problems.append(ActionProblem("the action says nothing about loading: add load_cluster, "
                                      "load_all_clusters: true or skip: true", "action"))
    elif len(loads) > 1:
        problems.append(ActionProblem(f"{loads[1]} conflicts with {loads[0]}: choose one",
                                      loads[1]))
    else:
        key = loads[0]
        value = data[key]
        if key == "load_cluster":
            items = value if isinstance(value, list) else [value]
            if not items:
                problems.append(ActionProblem("load_cluster: empty list", key))
            for i, label in enumerate(items):
                where = (key, i) if isinstance(value, list) else key
                if not isinstance(label, str) or not label.strip():
                    problems.append(ActionProblem(f"load_cluster: expected a label or "
                                                  f"$query_label, got {label!r}", where))
                elif label.startswith("$") and label != QUERY_LABEL:
                    problems.append(ActionProblem(f"unknown variable {label!r}; the only "
                                                  f"variable is $query_label", where,
                                                  length=len(label)))
                elif label != QUERY_LABEL and labels is not None:
                    msg = label_problem(label, labels)
                    if msg:
                        problems.append(ActionProblem(msg, where, length=len(label)))
            if items == [QUERY_LABEL]:
                kind = "query_label"
            elif QUERY_LABEL in items:
                problems.append(ActionProblem("$query_label stands alone: it cannot be listed "
                                              "with other labels", key))
            else:
                kind, clusters = "clusters", tuple(str(x) for x in items)
        elif value is not True:
            problems.append(ActionProblem(f"{key}: expected true, got {value!r} "
                                          f"(remove the key instead of writing false)", key))
        else:
            kind = "all" if key == "load_all_clusters" else "skip"
    if kind == "skip" and loads == ["skip"]:
        for key in ("precision", "layers", "load_cluster"):
            if key in data:
                problems.append(ActionProblem(f"{key} has no effect with skip: true", key))
    precision = data.get("precision")
    if precision is not None and precision not in PRECISIONS:
        hint = suggest(str(precision).lower(), PRECISIONS)
        problems.append(ActionProblem(
            f"bad precision {precision!r}: choose one of " + ", ".join(PRECISIONS)
            + (f"; did you mean {hint!r}?" if hint else ""), "precision",
            length=len(str(precision))))
    layers, runs = None, ()
    if "layers" in data:
        runs, written = layer_runs(data["layers"])
        problems.extend(written)
        layers = None if runs is None else layer_numbers(runs)
    micro = data.get("enable_micro_sampling", False)
    if not isinstance(micro, bool):
        problems.append(ActionProblem(f"enable_micro_sampling: expected true or false, got "
                                      f"{micro!r}", "enable_micro_sampling"))
    if problems:
        return None, problems, runs or ()
    return Action(kind, clusters, precision, layers, bool(micro)), [], runs or ()
