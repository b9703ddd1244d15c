"""The release gate's bookkeeping (scripts/release_gate.sh, docs/ci-cd.md): the summary file, why a
step passed or failed (read from the step's `--json` output, else the last line of its log), and
the closing table. Standard library only, so any python3 runs it.

    release_gate_report.py init SUMMARY KEY=VALUE...          inputs; every step "not_run"
    release_gate_report.py step SUMMARY NAME STATUS RC SECONDS REASON [KEY=VALUE...]
    release_gate_report.py finish SUMMARY EXIT_CODE            passed, failed_step, reason, times
    release_gate_report.py table SUMMARY                       the closing table (text)
    release_gate_report.py reason NAME RC STDOUT LOG           one line: what the step found
    release_gate_report.py fingerprint MODEL_INFO_JSON         the combined fingerprint
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

STEPS = ("build-runtime", "model-info", "migrate", "bench", "shadow", "tune")
FORMAT = 1
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PROGRESS = re.compile(r"^\[\s*[\d.]+s\] ")  # `[   41.2s] cases 3/12`: progress, not a verdict


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def read(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def write(path: str, doc: dict) -> None:
    """Whole or not at all: a temporary file in the same folder, fsynced, renamed."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2, ensure_ascii=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def pairs(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = value if value != "" else None
    return out


def init(summary: str, *items: str) -> None:
    write(summary, {"release_gate": FORMAT, "started_at": now(), "finished_at": None, "wall_s": None,
                    "passed": None, "exit_code": None, "failed_step": None, "reason": None,
                    "inputs": pairs(list(items)),
                    "steps": [{"name": s, "status": "not_run", "exit_code": None, "seconds": None,
                               "reason": None} for s in STEPS]})


def step(summary: str, name: str, status: str, rc: str, seconds: str, reason: str, *items: str) -> None:
    doc = read(summary)
    for s in doc["steps"]:
        if s["name"] == name:
            s.update(status=status, exit_code=int(rc) if rc != "" else None,
                     seconds=round(float(seconds), 1) if seconds != "" else None, reason=reason,
                     **pairs(list(items)))
    write(summary, doc)


def finish(summary: str, exit_code: str) -> None:
    doc = read(summary)
    failed = next((s for s in doc["steps"] if s["status"] in ("failed", "interrupted")), None)
    doc.update(finished_at=now(), exit_code=int(exit_code), passed=int(exit_code) == 0,
               failed_step=failed["name"] if failed else None,
               reason=f"{failed['name']}: {failed['reason']}" if failed else None,
               wall_s=round(sum(s["seconds"] or 0 for s in doc["steps"]), 1))
    write(summary, doc)


def table(summary: str) -> str:
    doc = read(summary)
    verdict = "INTERRUPTED" if doc["exit_code"] == 130 else "FAILED"
    head = ("release gate: PASSED" if doc["passed"] else
            f"release gate: {verdict} at {doc['failed_step'] or '?'} (exit {doc['exit_code']})")
    lines = [head]
    for s in doc["steps"]:
        took = f"{s['seconds']:7.1f} s" if s["seconds"] is not None else " " * 9
        status = s["status"].upper() if s["status"] in ("failed", "interrupted") else s["status"]
        lines.append(f"  {s['name']:<14}{status:<12}{took}  {s['reason'] or ''}".rstrip())
    return "\n".join(lines)


def last_line(log: str) -> str:
    """The last line of a log that is not progress: a KITE error is one line (exit 1 or 2)."""
    try:
        with open(log, encoding="utf-8", errors="replace") as fh:
            lines = [_ANSI.sub("", ln).strip() for ln in fh]
    except OSError:
        return "no log"
    lines = [ln for ln in lines if ln and not _PROGRESS.match(ln)]
    return lines[-1].removeprefix("error: ") if lines else "no output"


def _json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _num(v) -> str:
    return "not measured" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _short(fp: str | None) -> str:
    return (fp or "?").removeprefix("kite-fp1:")[:12]


def migrate_reason(rc: int, doc: dict) -> str:
    files = doc.get("files") or []
    count = {a: sum(f["action"] == a for f in files) for a in ("migrate", "done", "skip", "refuse")}
    already = sum(f["action"] == "skip" and f["reason"] == "already on the new fingerprint" for f in files)
    others = count["skip"] - already
    if count["refuse"]:
        why = next(f["reason"] for f in files if f["action"] == "refuse")
        return f"{count['refuse']} of {len(files)} states refused: {why}"
    moved = count["migrate"] + count["done"]
    if moved == 0:
        same = _short(doc.get("old")) == _short(doc.get("new"))[:len(_short(doc.get("old")))]
        tail = " (the old and new model have the same fingerprint)" if same else ""
        return (f"nothing to move: {already} state{'s' if already != 1 else ''} already on "
                f"{_short(doc.get('new'))}{tail}" + (f"; {others} made by other models left alone" if others else ""))
    return (f"moved {moved} state{'s' if moved != 1 else ''} {_short(doc.get('old'))} → {_short(doc.get('new'))}"
            + (f"; {already} already on it" if already else "")
            + (f"; {others} made by other models left alone" if others else ""))


def _threshold(t: dict) -> str:
    side = "above its max" if t["op"] == "max" else "below its min"
    if t.get("value") is None:
        return f"{t['metric']} not measured (limit {t['op']} {t['limit']:g})"
    return f"{t['metric']} {_num(t['value'])} {side} {t['limit']:g}"


def bench_reason(rc: int, doc: dict) -> str:
    cases = doc.get("cases") or []
    states = {c["state"]["file"]: c["state"]["reused"] for c in cases if c.get("state")}
    reused = sum(states.values())
    where = doc.get("thresholds_source") or "the seed's defaults"
    if doc.get("error"):
        return f"a case failed after {len(cases)} of {doc.get('cases_total')}: {doc['error']}"
    failed = [t for t in doc.get("thresholds") or [] if not t.get("pass")]
    if failed:
        return f"{'; '.join(_threshold(t) for t in failed)} ({where})"
    overall = (doc.get("summary") or {}).get("overall") or {}
    fused, full = overall.get("fused") or {}, overall.get("full") or {}
    return (f"{len(cases)} cases, {len(doc.get('thresholds') or [])} thresholds met ({where}); fused F1 "
            f"{_num(fused.get('f1'))} (full prefill {_num(full.get('f1'))}), PPL × full {_num(fused.get('ppl_ratio'))}; "
            f"states: {reused} reused, {len(states) - reused} made")


def shadow_reason(rc: int, doc: dict) -> str:
    line = (f"{doc['golden']} vs {doc['candidate']}: substantive {doc['substantive_rate']:.1%}, noise floor "
            f"{doc['noise_floor']:.1%}, excess {doc['excess']:.1%} (max {doc['max_substantive']:.1%}) over "
            f"{doc['cases']} cases")
    if doc.get("examples"):
        ex = doc["examples"][0]
        line += f"; e.g. {ex['id']}: {ex['golden'].strip()!r} → {ex['candidate'].strip()!r}"
    return line


def tune_reason(rc: int, doc: dict) -> str:
    points = doc.get("points") or []
    if doc.get("error"):
        return f"a point failed: {doc['error']}"
    best = doc.get("best")
    if best:
        objective = (doc.get("objectives") or [{}])[0].get("name")
        params = _params(best["params"])
        written = [w for w in doc.get("written") or [] if w.endswith((".yaml", ".yml"))]
        return (f"best of {len(points)} points: {params} ({objective} {_num(best['figures'].get(objective))}); "
                f"wrote {written[-1] if written else 'no config'}")
    broken = [f"{b['constraint']} broken by {len(b['points'])} (e.g. {_params(b['points'][0]['params'])}: "
              f"{b['points'][0]['why']})" for b in doc.get("broken") or [] if b["points"]]
    return f"no point of {len(points)} meets the constraints: {'; '.join(broken) or 'none measured'}"


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


REASONS = {"migrate": migrate_reason, "bench": bench_reason, "shadow": shadow_reason, "tune": tune_reason}


def reason(name: str, rc: str, stdout: str, log: str) -> str:
    doc = _json(stdout) if name in REASONS else None
    if doc is None or int(rc) not in (0, 1):
        return last_line(log)  # bad input (exit 2), a crash, or a step without JSON
    try:
        return REASONS[name](int(rc), doc)
    except (KeyError, TypeError, ValueError, StopIteration) as exc:
        return f"{last_line(log)} (its --json output unreadable here: {exc!r})"


def fingerprint(info: str) -> str:
    doc = _json(info)
    fp = (doc or {}).get("fingerprint")
    if not fp:
        raise SystemExit(f"{info}: no fingerprint in `kite model info --json` output")
    return fp


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "init":
        init(*args)
    elif cmd == "step":
        step(*args)
    elif cmd == "finish":
        finish(*args)
    elif cmd == "table":
        print(table(*args))
    elif cmd == "reason":
        print(" ".join(reason(*args).split()))
    elif cmd == "fingerprint":
        print(fingerprint(*args))
    else:
        print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
