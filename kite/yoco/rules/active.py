"""The rule set a server decides with, swapped whole on reload: a bad file changes nothing."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from kite.errors import BadInput
from kite.yoco.rules.errors import RuleSetError
from kite.yoco.rules.ruleset import RuleSet, load_rules


@dataclass(frozen=True, slots=True)
class ReloadError:
    when: float
    source: str
    message: str  # the full multi-error report


class ActiveRules:
    """Holds one compiled `RuleSet`. `current` is a plain attribute read (no lock on the request
    path); `reload`/`switch` compile the whole new file first, then swap the reference. With
    `n_layers`, every set it holds is checked against that many layers (RuleSetError if not)."""

    def __init__(self, ruleset: RuleSet, rules_dir: str | os.PathLike[str] | None = None,
                 labels: Iterable[str] | None = None, n_layers: int | None = None):
        self.current = ruleset if n_layers is None else ruleset.for_layers(n_layers)
        self.rules_dir = Path(rules_dir) if rules_dir else Path(ruleset.source).parent
        self.labels = None if labels is None else list(labels)
        self.n_layers = n_layers
        self.last_error: ReloadError | None = None
        self._lock = threading.Lock()  # one reload at a time; readers never wait

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kw) -> "ActiveRules":
        return cls(load_rules(path, kw.get("labels"), kw.get("n_layers")), **kw)

    def reload(self, path: str | os.PathLike[str] | None = None) -> RuleSet:
        """Recompile `path` (default: the active file) and swap it in. On error the old set keeps
        serving, `last_error` records the report, and RuleSetError/BadInput is raised."""
        target = Path(path) if path else Path(self.current.source)
        with self._lock:
            try:
                new = load_rules(target, self.labels, self.n_layers)
            except RuleSetError as exc:
                self.last_error = ReloadError(time.time(), str(target), exc.report())
                raise
            except BadInput as exc:
                self.last_error = ReloadError(time.time(), str(target), str(exc))
                raise
            self.current = new
            return new

    def switch(self, version: str) -> RuleSet:
        """Switch to `yoco_rules_<version>.yaml` in `rules_dir` (`v1` is `yoco_rules.yaml`)."""
        return self.reload(self.path_for(version))

    def path_for(self, version: str) -> Path:
        v = version.strip()
        if not v or any(c in v for c in "/\\") or v.startswith("."):
            raise BadInput(f"rule version {version!r}: expected a name like v2")
        name = "yoco_rules.yaml" if v == "v1" else f"yoco_rules_{v}.yaml"
        return self.rules_dir / name

    def status(self) -> dict:
        info = self.current.info()
        err = self.last_error
        info["last_error"] = None if err is None else {"when": err.when, "source": err.source,
                                                       "message": err.message}
        return info


def default_rules_path() -> Path:
    """`$KITE_HOME/rules/yoco_rules.yaml` if it exists, else the checkout's `rules/yoco_rules.yaml`."""
    from kite.paths import kite_home, repo_root

    home = kite_home() / "rules" / "yoco_rules.yaml"
    if home.exists():
        return home
    root = repo_root()
    return root / "rules" / "yoco_rules.yaml" if root else home


def resolve_rules_path(spec: str | Path) -> Path:
    """A rule file named in the config or on the command line: as given when it exists (absolute
    or relative to the working folder), else under $KITE_HOME, else under the checkout."""
    from kite.paths import kite_home, repo_root

    p = Path(spec).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve()
    for base in (kite_home(), repo_root()):
        if base is not None and (base / p).exists():
            return (base / p).resolve()
    raise BadInput(f"rules file {spec}: not found (looked in the working folder, $KITE_HOME and the checkout)")
