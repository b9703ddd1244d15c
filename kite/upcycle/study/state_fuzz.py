"""Mutants of a state through the public load path, each outcome classified.

Every mutant (:mod:`kite.upcycle.format.mutants`) is written to a file and loaded as
``kite generate --upc`` loads it (``StateFile`` + ``load_prefix``, every cluster, every layer) in
a child process, so that a native crash is counted instead of ending the run. Outcomes:

* ``refused``: a :class:`kite.errors.KiteError` of one line (what a reader must say);
* ``crash``: the child died of a signal (or hung past the timeout) on this mutant;
* ``internal``: any other exception (or a KiteError of several lines);
* ``identical``: loaded, every key and value equal to the original's (an edit that changes nothing
  the load reads, e.g. a label);
* ``different``: loaded without an error into KV that differs from the original's.

A child process loads the model once and runs a batch of mutants, each load in a fork of itself (a
crash there kills the fork alone), writing one JSON line per outcome as it goes; should the child
itself die, the mutant after its last line is counted a crash and a new child takes the rest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

LOADER = "kite.upcycle.study.state_fuzz:load_state"
OUTCOMES = ("refused", "crash", "internal", "identical", "different")
BAD_OUTCOMES = ("crash", "internal", "different")


@dataclass(frozen=True, slots=True)
class Outcome:
    index: int
    kind: str
    name: str
    outcome: str
    detail: str = ""
    ms: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def counts(outcomes) -> dict[str, dict[str, int]]:
    """{kind: {outcome: count}} with every outcome named (zeros included)."""
    by = Counter((o.kind, o.outcome) for o in outcomes)
    kinds = sorted({o.kind for o in outcomes})
    return {k: {out: by[(k, out)] for out in OUTCOMES} for k in kinds}


def classify_exception(exc: BaseException) -> tuple[str, str]:
    from kite.errors import KiteError

    text = str(exc)
    if isinstance(exc, KiteError) and "\n" not in text.strip():
        return "refused", text[:300]
    return "internal", f"{type(exc).__name__}: {text[:300]}"


def make_fuzz_state(model_dir: str | Path, text: str, out: str | Path, codec: str = "ratio=4", n_clusters: int = 3,
                    content: bool = True) -> Path:
    """A small addressed state of ``text`` on the model in ``model_dir`` (CPU), PCA-coded by default
    so that loads go through the native decoder: what the fuzzer mutates. ``content=False``: without
    the header's content digest, as states were written before it (a reader then has only the
    parts' own structure to go by)."""
    from kite.model import load_model
    from kite.upcycle import codec as codecs
    from kite.upcycle.compress import CompressSettings, compress_document

    lm = load_model(str(model_dir), device="cpu")
    compress_document(lm, text, out, CompressSettings(codec=codecs.settings_for(codec), n_clusters=n_clusters,
                                                      min_span_tokens=8, max_span_tokens=24), address=True)
    if not content:
        from kite.upcycle.format.mutants import without_content

        Path(out).write_bytes(without_content(Path(out).read_bytes()))
    return Path(out)


def _same(a, b) -> bool:
    import torch

    if len(a.keys) != len(b.keys) or a.next_position != b.next_position:
        return False
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


def load_state(path, lm):
    """The public load path (``kite generate --upc``): ``StateFile`` + ``load_prefix``, every
    cluster and layer. Returns the KV prefix."""
    from kite.upcycle.format import StateFile
    from kite.upcycle.load import load_prefix

    with StateFile(path) as sf:
        return load_prefix(sf, lm)[0]


def _loader(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _load_one(path, lm, base, load) -> tuple[str, str]:
    try:
        prefix = load(path, lm)
    except Exception as exc:  # every exception is a finding: classified, never raised
        return classify_exception(exc)
    return ("identical", "") if _same(prefix, base) else ("different", "")


def run_batch(model_dir: str, state_path: str, seed: int, start: int, stop: int, out_path: str,
              kinds=None, timeout: float = 60.0, loader: str = LOADER) -> None:
    """The child's work: mutants ``start`` .. ``stop - 1``, one JSON line each in ``out_path``."""
    import torch

    from kite.model import load_model
    from kite.upcycle.format.mutants import MUTANT_KINDS, make_mutant

    torch.set_num_threads(1)
    lm = load_model(model_dir, device="cpu")
    data = Path(state_path).read_bytes()
    load = _loader(loader)
    base = load(Path(state_path), lm)
    work = Path(tempfile.mkdtemp(prefix="kite-fuzz-"))
    at = start
    while at < stop:
        # the loads run in a fork of this process (the model loaded once): a native crash kills the
        # fork, which names the mutant it was on; a new fork goes on after it
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _run_loads(data, at, stop, seed, kinds or MUTANT_KINDS, work, out_path, lm, base, timeout, load)
            except BaseException:
                code = 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        rows = [json.loads(line) for line in Path(out_path).read_text().splitlines() if line.strip()]
        last = max((r["start"] for r in rows if "start" in r), default=at - 1)
        ended = {r["index"] for r in rows if "outcome" in r}
        if last < at or last in ended:
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                break
            raise RuntimeError(f"the fuzz fork ended with status {status} outside a load")
        m = make_mutant(data, last, seed, kinds or MUTANT_KINDS)
        sig = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else None
        detail = (f"hung for more than {timeout:g} s" if sig == "SIGALRM" else f"killed by {sig}" if sig
                  else f"the load ended the process with exit code {os.waitstatus_to_exitcode(status)}")
        with open(out_path, "a") as out:
            out.write(json.dumps(Outcome(m.index, m.kind, m.name, "crash", detail).to_dict()) + "\n")
        for leftover in work.glob("*.upc"):
            leftover.unlink()
        at = last + 1
    work.rmdir()


def _run_loads(data, start, stop, seed, kinds, work, out_path, lm, base, timeout, load) -> None:
    from kite.upcycle.format.mutants import mutants

    with open(out_path, "a", buffering=1) as out:
        for m in mutants(data, stop, seed, start, kinds):
            path = work / f"m{m.index}.upc"
            path.write_bytes(m.data)
            out.write(json.dumps({"start": m.index}) + "\n")   # a crash is the mutant after this line
            t = time.perf_counter()
            signal.alarm(max(1, int(timeout)))                  # a hang ends the fork with SIGALRM
            outcome, detail = _load_one(path, lm, base, load)
            signal.alarm(0)
            ms = round((time.perf_counter() - t) * 1e3, 3)
            out.write(json.dumps(Outcome(m.index, m.kind, m.name, outcome, detail, ms).to_dict()) + "\n")
            path.unlink()


def _run_range(model_dir, state_path, seed, start, stop, kinds, timeout, loader) -> list[Outcome]:
    from kite.upcycle.format.mutants import MUTANT_KINDS, make_mutant

    kinds = tuple(kinds or MUTANT_KINDS)
    data = Path(state_path).read_bytes()
    done: list[Outcome] = []
    at = start
    env = {**os.environ, "KITE_VERIFY_RECORD": "0", "OMP_NUM_THREADS": "1"}
    while at < stop:
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
            cmd = [sys.executable, "-W", "ignore::RuntimeWarning", "-m", "kite.upcycle.study.state_fuzz", model_dir, str(state_path), str(seed),
                   str(at), str(stop), out.name, ",".join(kinds), loader]
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
                rc, err = proc.returncode, proc.stderr
            except subprocess.TimeoutExpired:
                rc, err = None, f"timed out after {timeout} s"
            lines = [json.loads(line) for line in Path(out.name).read_text().splitlines() if line.strip()]
        got = [Outcome(**row) for row in lines if "outcome" in row]
        done.extend(got)
        started = [row["start"] for row in lines if "start" in row]
        if rc == 0 and (not got or got[-1].index == stop - 1):
            break
        if not started:    # the child failed before its first mutant: nothing of this range ran
            raise RuntimeError(f"fuzz child failed before its first mutant (exit {rc}): {err.strip()[-2000:]}")
        bad = started[-1]
        if got and got[-1].index == bad:   # died between mutants (cannot happen unless killed)
            at = bad + 1
            continue
        m = make_mutant(data, bad, seed, kinds)
        if rc is None:
            detail = err
        elif rc < 0:
            detail = f"killed by {signal.Signals(-rc).name}"
        else:
            detail = f"child exited {rc}: {err.strip().splitlines()[-1][:300] if err.strip() else ''}"
        done.append(Outcome(bad, m.kind, m.name, "crash", detail))
        at = bad + 1
    return done


def fuzz_states(model_dir: str | Path, state_path: str | Path, n: int, *, seed: int = 0, batch: int = 250,
                workers: int = 1, kinds=None, timeout: float = 600.0, loader: str = LOADER) -> list[Outcome]:
    """Outcomes of mutants 0 .. n-1 of the state (seeded), loaded on the model in ``model_dir`` on
    the CPU, ``batch`` mutants per child process, ``workers`` children at a time. ``loader``:
    ``"module:function"`` that loads a state file on the model (``function(path, lm)`` -> KV
    prefix; default :func:`load_state`, the public load path)."""
    ranges = [(s, min(n, s + batch)) for s in range(0, n, batch)]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        parts = pool.map(lambda r: _run_range(str(model_dir), str(state_path), seed, r[0], r[1], kinds, timeout,
                                                loader),
                         ranges)
        return sorted((o for part in parts for o in part), key=lambda o: o.index)


if __name__ == "__main__":
    model, state, seed_, start_, stop_, out_, kinds_, loader_ = sys.argv[1:9]
    run_batch(model, state, int(seed_), int(start_), int(stop_), out_, tuple(kinds_.split(",")), loader=loader_)
