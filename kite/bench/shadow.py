"""Shadow validation: a candidate pipeline answers the same cases as the golden one; their token
diffs are classified, and only what exceeds the golden pipeline's own noise counts.

Classes, from mildest: `identical` (same text), `whitespace_punctuation` (same words in the same
order), `stop_words` (same words once stop words are dropped, case-insensitive), `substantive`.
The noise floor is the golden config run a second time with the next sampling seed: with
temperature 0 it is zero; with sampling it is how often the golden pipeline disagrees with
itself.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from kite.errors import BadInput

if TYPE_CHECKING:
    from kite.model import LoadedModel

CLASSES = ("identical", "whitespace_punctuation", "stop_words", "substantive")
_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)
STOP_WORDS = frozenset("""a an the and or but if then so of to in on at by for with from as is are was were be
been being it its this that these those there here which who whom whose what when where why how
i you he she we they me him her us them my your his our their not no do does did has have had will
would shall should can could may might must also just than too very""".split())


class ShadowConfig(BaseModel):
    """One pipeline of a shadow comparison (a small YAML file; docs/PERFORMANCE.md, "Bench")."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str | None = None
    method: Literal["full", "window", "kivi", "snapkv", "state", "fused"] = "fused"
    ratio: float = Field(4.0, ge=1)  # state compression (fused) = the baselines' byte budget
    rules: str | None = None  # fused: the YOCO rule file (default rules/yoco_rules.yaml)
    upcycle_config: str | None = None  # fused: upcycle_config.yaml (default configs/...)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    max_new_tokens: int = Field(32, ge=1)


def load_shadow_config(path: str | Path) -> ShadowConfig:
    from kite.yaml_model import load_yaml_model

    return load_yaml_model(Path(path), ShadowConfig)


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def _words(toks: list[str]) -> list[str]:
    return [t for t in toks if re.match(r"\w", t)]


def classify(golden: str, candidate: str) -> str:
    """The mildest class that explains the difference between two answers."""
    if golden == candidate:
        return "identical"
    g, c = _words(tokens(golden)), _words(tokens(candidate))
    if g == c:
        return "whitespace_punctuation"
    if [w.lower() for w in g if w.lower() not in STOP_WORDS] == \
            [w.lower() for w in c if w.lower() not in STOP_WORDS]:
        return "stop_words"
    return "substantive"


def token_diff(golden: str, candidate: str) -> list[dict]:
    """The changed token runs: [{op, golden, candidate}]."""
    g, c = tokens(golden), tokens(candidate)
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=g, b=c, autojunk=False).get_opcodes():
        if op != "equal":
            out.append({"op": op, "golden": " ".join(g[i1:i2]), "candidate": " ".join(c[j1:j2])})
    return out


def rates(classes: list[str]) -> dict[str, float]:
    n = max(1, len(classes))
    return {k: round(sum(c == k for c in classes) / n, 4) for k in CLASSES}


@dataclass
class ShadowReport:
    golden: str
    candidate: str
    cases: int
    rates: dict[str, float]
    noise_rates: dict[str, float]
    substantive_rate: float
    noise_floor: float
    excess: float  # substantive rate above the noise floor
    max_substantive: float
    passed: bool
    examples: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def compare(case_ids: list[str], questions: list[str], golden: list[str], golden_again: list[str],
            candidate: list[str], max_substantive: float, names: tuple[str, str] = ("golden", "candidate"),
            max_examples: int = 10) -> ShadowReport:
    """Classify every case's diff and the golden pipeline's own (the noise floor)."""
    cls = [classify(g, c) for g, c in zip(golden, candidate)]
    noise = [classify(g, g2) for g, g2 in zip(golden, golden_again)]
    r, nr = rates(cls), rates(noise)
    excess = round(max(0.0, r["substantive"] - nr["substantive"]), 4)
    rows = [{"id": i, "question": q, "class": k, "noise_class": nk, "golden": g, "candidate": c}
            for i, q, k, nk, g, c in zip(case_ids, questions, cls, noise, golden, candidate)]
    examples = [{**row, "diff": token_diff(row["golden"], row["candidate"])}
                for row in rows if row["class"] == "substantive"][:max_examples]
    return ShadowReport(names[0], names[1], len(cls), r, nr, r["substantive"], nr["substantive"], excess,
                        max_substantive, excess <= max_substantive, examples, rows)


def answer_all(lm: LoadedModel, cfg: ShadowConfig, cases, states_dir: Path, *, seed: int | None = None,
               progress=None, stage: str = "answers") -> list[str]:
    """The texts `cfg`'s pipeline generates for `cases` (in order)."""
    with contextlib.ExitStack() as cleanup:
        return _answer_all(lm, cfg, cases, states_dir, seed, progress, stage, cleanup)


def _answer_all(lm: LoadedModel, cfg, cases, states_dir, seed, progress, stage, cleanup) -> list[str]:
    from kite.bench.document import prefill_document
    from kite.bench.methods import BASELINES, Fused
    from kite.bench.runner import prompt_ids
    from kite.bench.states import ensure_state
    from kite.upcycle import open_pipeline

    pipe = open_pipeline(lm=lm, upcycle_config=cfg.upcycle_config, ratio=cfg.ratio, tagger=cfg.method == "fused")
    if cfg.method == "fused":
        from kite.yoco.health import HealthStore
        from kite.yoco.rules import default_rules_path, load_rules

        rules = load_rules(Path(cfg.rules) if cfg.rules else default_rules_path(), None, lm.geometry.n_layers)
        # A fresh health store for each pass: every pass starts from what the pipeline knows
        # before any of these cases (a shared store would let the first pass steer the next).
        tmp = tempfile.TemporaryDirectory(prefix="kite-shadow-health-")
        cleanup.callback(tmp.cleanup)
        health = HealthStore(Path(tmp.name) / "health.sqlite")
        cleanup.callback(health.close)
        method = Fused(tagger=pipe.tagger, rules=rules, health=health)
    else:
        method = BASELINES[cfg.method]()
    gen = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
               seed=cfg.seed if seed is None else seed)
    texts: list[str] = []
    current = None
    for i, case in enumerate(cases):
        if current is None or current[0] != case.document_key:
            from kite.bench.document import document_ids

            ids = document_ids(lm, case.document)
            doc = prefill_document(lm, case.document_key, ids)
            state = ensure_state(pipe, case.document_key, ids, states_dir)
            prep = method.prepare(lm, doc, state.state_bytes)
            if method.uses_state:
                prep.data = state
            current = (case.document_key, doc, prep)
        _, doc, prep = current
        ans = method.answer(lm, doc, prep, case.question, prompt_ids(lm, case), gen)
        texts.append(ans.text)
        if progress:
            progress(stage, i + 1, len(cases))
    return texts


def run_shadow(golden_path: str | Path, candidate_path: str | Path, cases_path: str, *, model: str | None = None,
               states_dir: str | Path | None = None, max_substantive: float = 0.05,
               max_cases: int | None = None, progress=None) -> ShadowReport:
    from kite.bench.cases import load_cases
    from kite.bench.runner import check_lengths
    from kite.model import load_model

    golden, candidate = load_shadow_config(golden_path), load_shadow_config(candidate_path)
    if not 0 <= max_substantive <= 1:
        raise BadInput(f"--max-substantive {max_substantive}: a rate in 0-1")
    cases = load_cases(cases_path)[:max_cases]
    if states_dir is None:
        from kite.paths import kite_home

        states_dir = kite_home() / "bench-states"
    lm = load_model(model)
    check_lengths(lm, cases, max(golden.max_new_tokens, candidate.max_new_tokens), True)
    states = Path(states_dir)
    g = answer_all(lm, golden, cases, states, progress=progress, stage="golden")
    # Greedy decoding is deterministic: the second golden run would repeat the first.
    g2 = (list(g) if golden.temperature == 0 else
          answer_all(lm, golden, cases, states, seed=golden.seed + 1, progress=progress, stage="noise"))
    c = answer_all(lm, candidate, cases, states, progress=progress, stage="candidate")
    names = (golden.name or Path(golden_path).stem, candidate.name or Path(candidate_path).stem)
    return compare([x.id for x in cases], [x.question for x in cases], g, g2, c, max_substantive, names)
