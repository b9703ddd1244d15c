"""The flywheel (seed §2.3): per-label ratios from the health store, states re-encoded to them.

YOCO records, per (state, cluster label), the gain each load measured (:mod:`kite.yoco.health`).
``retune`` reads those records for the states of a folder, sums them per label, and moves each
label's ratio (:mod:`kite.upcycle.label_ratios`):

* a label loaded at least ``min_loads`` times whose loads hold quality (health ≥ ``hold_health``)
  is compressed further: ratio × ``step``, at most ``max_ratio``;
* one loaded that often with poor gain (health ≤ ``poor_health``) gets more bytes: ratio ÷
  ``step``, at least ``min_ratio``;
* any other keeps its ratio (too few loads to tell, or in between).

Then every state whose clusters now have a higher ratio than they were coded at is re-encoded
from its stored form, without the document: each such part is decoded and coded again on the
same layer codec at its own, smaller widths (:mod:`kite.upcycle.codec.part_widths`); the other
blobs are copied as they are, and the file is replaced atomically (its id, and so its health
records, stay). A label whose ratio went *down* cannot get back what its states no longer hold:
those clusters are listed as needing the document (``kite upcycle compress`` with the new map
gives them the bytes). The new map is written to ``label_ratios.yaml`` in the folder, which
``compression.label_ratios`` can name so that new states follow it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from kite.atomic import write_text
from kite.errors import BadInput
from kite.upcycle import (LABEL_RATIOS_FILE, StateFile, cluster_ratios, not_recodable, read_label_ratios,
                          recode_clusters)
from kite.yoco.fused import state_id_of
from kite.yoco.health import DEFAULT_GAIN_SCALE, health_from_gain


@dataclass(frozen=True)
class RetunePolicy:
    min_loads: int = 5          # loads of a label (over the folder's states) before its ratio moves
    hold_health: float = 0.75   # health at or above: the loads hold quality (gain ≥ +1 % at the default scale)
    poor_health: float = 0.5    # health at or below: poor measured gain (≤ 0)
    step: float = 1.5           # the factor a ratio moves by (the seed's 15 % → 10 % kept)
    min_ratio: float = 2.0
    max_ratio: float = 32.0

    def check(self) -> "RetunePolicy":
        if self.min_loads < 1:
            raise BadInput(f"--min-loads {self.min_loads}: at least 1")
        if not 0 <= self.poor_health < self.hold_health <= 1:
            raise BadInput(f"--poor-health {self.poor_health:g} / --hold-health {self.hold_health:g}: "
                           "need 0 ≤ poor < hold ≤ 1")
        if self.step <= 1:
            raise BadInput(f"--step {self.step:g}: a ratio moves by a factor > 1")
        if not 1 < self.min_ratio <= self.max_ratio:
            raise BadInput(f"--min-ratio {self.min_ratio:g} / --max-ratio {self.max_ratio:g}: need 1 < min ≤ max")
        return self


@dataclass
class LabelDecision:
    label: str
    states: int
    loads: int
    mean_gain: float        # load-weighted over the states
    health: float | None    # None: never loaded (a label only the ratios file names)
    ratio_before: float
    ratio_after: float
    why: str


@dataclass
class StateRetune:
    path: str
    action: str                     # "retuned" | "unchanged" | "skipped"
    bytes_before: int
    bytes_after: int
    retuned: dict[str, float] = field(default_factory=dict)          # label -> new ratio
    needs_document: dict[str, float] = field(default_factory=dict)   # label -> the ratio it asks for
    reason: str = ""


@dataclass
class RetuneReport:
    labels: list[LabelDecision]
    states: list[StateRetune]
    ratios_file: str | None
    dry_run: bool

    def to_dict(self) -> dict:
        before = sum(s.bytes_before for s in self.states)
        after = sum(s.bytes_after for s in self.states)
        return {"labels": [asdict(d) for d in self.labels], "states": [asdict(s) for s in self.states],
                "ratios_file": self.ratios_file, "dry_run": self.dry_run,
                "bytes_before": before, "bytes_after": after}


def decide(records_by_state: dict[str, list], current: dict[str, float], default_ratio: float,
           policy: RetunePolicy, seen: dict[str, int] | None = None,
           gain_scale: float = DEFAULT_GAIN_SCALE) -> list[LabelDecision]:
    """Each label's new ratio from its health records (``records_by_state``: state id → its
    :class:`kite.yoco.health.HealthRecord` list). ``current``: the labels' ratios now (a label not
    in it stands at ``default_ratio``). ``seen``: each label's loads when its ratio last moved; a
    ratio moves again only on ``min_loads`` loads since (the same evidence never moves it twice).
    ``gain_scale``: the health store's (gain → health)."""
    sums: dict[str, list] = {}   # label -> [states, loads, gain x loads]
    for recs in records_by_state.values():
        for r in recs:
            s = sums.setdefault(r.cluster, [0, 0, 0.0])
            s[0] += 1
            s[1] += r.loads
            s[2] += r.mean_gain * r.loads
    out = []
    for label in sorted(set(sums) | set(current)):
        n_states, loads, gsum = sums.get(label, [0, 0, 0.0])
        gain = gsum / loads if loads else 0.0
        health = health_from_gain(gain, gain_scale) if loads else None   # never loaded: no health
        before = current.get(label, default_ratio)
        fresh = loads - (seen or {}).get(label, 0)
        fresh = loads if fresh < 0 else fresh   # the store was reset since: all its loads are new
        if fresh < policy.min_loads:
            since = " since its last move" if (seen or {}).get(label) else ""
            after, why = before, f"{fresh} loads{since} < {policy.min_loads}: too few to tell"
        elif health >= policy.hold_health:
            after = min(policy.max_ratio, before * policy.step)
            why = f"loads hold quality (health {health:.2f} ≥ {policy.hold_health:g}): compress further"
        elif health <= policy.poor_health:
            after = max(policy.min_ratio, before / policy.step)
            why = f"poor measured gain (health {health:.2f} ≤ {policy.poor_health:g}): give it more bytes"
        else:
            after, why = before, f"health {health:.2f} between {policy.poor_health:g} and {policy.hold_health:g}"
        out.append(LabelDecision(label, n_states, loads, round(gain, 6),
                                 None if health is None else round(health, 4),
                                 round(before, 4), round(after, 4), why))
    return out


def retune_state(path: str | Path, ratios: dict[str, float], *, regenerator=None, dry_run: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> StateRetune:
    """Re-encode the clusters of the state at ``path`` whose label's ratio in ``ratios`` is higher
    than the one they were coded at, from their stored form (:func:`kite.upcycle.recode_clusters`)."""
    path = Path(path)
    with StateFile(path) as state:
        meta = state.meta
        size = path.stat().st_size
        why = not_recodable(meta)
        if why is not None:
            return StateRetune(str(path), "skipped", size, size, reason=why)
        todo: dict[int, float] = {}
        needs: dict[str, float] = {}
        for i, (cl, r) in enumerate(zip(meta["clusters"], cluster_ratios(meta))):
            want = ratios.get(cl["label"])
            if want is None or abs(want - r) < 1e-9:
                continue
            if want > r:
                todo[i] = want
            else:
                needs[cl["label"]] = want
        labels = [cl["label"] for cl in meta["clusters"]]
    retuned = {labels[i]: r for i, r in todo.items()}
    if not todo:
        return StateRetune(str(path), "unchanged", size, size, needs_document=needs)
    after = size if dry_run else recode_clusters(path, todo, regenerator=regenerator, progress=progress)
    return StateRetune(str(path), "retuned", size, after, retuned=retuned, needs_document=needs)


def retune(upcycle_dir: str | Path, health, *, policy: RetunePolicy | None = None, default_ratio: float,
           regenerator=None, dry_run: bool = False,
           progress: Callable[[str, int, int], None] | None = None) -> RetuneReport:
    """The flywheel over a folder of states: decide the label ratios from ``health`` (a
    :class:`kite.yoco.health.HealthStore`), write them to ``label_ratios.yaml`` there and re-encode
    the states that can follow. ``default_ratio``: a label's ratio before its first retune."""
    policy = (policy or RetunePolicy()).check()
    folder = Path(upcycle_dir)
    if not folder.is_dir():
        raise BadInput(f"--upcycle-dir {folder}: no such folder")
    paths = sorted(folder.glob("*.upc"))
    if not paths:
        raise BadInput(f"--upcycle-dir {folder}: no .upc states in it")
    ratios_file = folder / LABEL_RATIOS_FILE
    current = read_label_ratios(ratios_file) if ratios_file.exists() else {}
    seen = _read_seen(ratios_file)
    decisions = decide({state_id_of(p): health.records(state_id_of(p)) for p in paths}, current, default_ratio,
                       policy, seen, getattr(health, "gain_scale", DEFAULT_GAIN_SCALE))
    new = {d.label: d.ratio_after for d in decisions if d.ratio_after != d.ratio_before or d.label in current}
    seen.update({d.label: d.loads for d in decisions if d.ratio_after != d.ratio_before})
    if not dry_run:
        _write_ratios(ratios_file, new, decisions, seen)
    states = []
    for n, p in enumerate(paths):
        states.append(retune_state(p, new, regenerator=regenerator, dry_run=dry_run))
        if progress:
            progress("retune", n + 1, len(paths))
    return RetuneReport(decisions, states, None if dry_run else str(ratios_file), dry_run)


def _read_seen(path: Path) -> dict[str, int]:
    """The loads each label had when its ratio last moved (``evidence:`` of the ratios file)."""
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    seen = data.get("evidence") if isinstance(data, dict) else None
    return {str(k): int(v) for k, v in seen.items()} if isinstance(seen, dict) else {}


def _write_ratios(path: Path, ratios: dict[str, float], decisions: list[LabelDecision],
                  seen: dict[str, int]) -> None:
    why = {d.label: f"{d.ratio_before:g} → {d.ratio_after:g}: {d.why} ({d.loads} loads)" for d in decisions}
    lines = [f"# written by `kite upcycle retune` {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
             "# per clause label, the compression ratio of its clusters (kite.upcycle.label_ratios);",
             "# evidence: each label's loads when its ratio last moved (it moves again on new loads only)"]
    lines += [f"# {label}: {why[label]}" for label in sorted(ratios) if label in why]
    lines.append(yaml.safe_dump({"label_ratios": {k: float(v) for k, v in sorted(ratios.items())},
                                 "evidence": dict(sorted(seen.items()))},
                                allow_unicode=True, sort_keys=True).rstrip())
    write_text(path, "\n".join(lines) + "\n")
