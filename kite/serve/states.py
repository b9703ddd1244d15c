"""The server's state store: one folder of `<id>.upc` files; ids never name a path outside it. A
model served from a GGUF file that embeds states (`kite gguf embed`) adds them, read-only."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import asdict, dataclass, field, replace
from collections.abc import Mapping
from pathlib import Path

from kite.errors import BadInput, KiteError
from kite.serve.quarantine import Quarantine
from kite.serve.settings import check_state_id

_log = logging.getLogger("kite.serve")


class StateNotFound(KiteError):
    """No state with that id (HTTP 404)."""


class StateExists(KiteError):
    """A state with that id exists and overwrite was not asked for (HTTP 409)."""


class StateReadOnly(StateExists):
    """The state is embedded in the model's GGUF file: it cannot be replaced or deleted (HTTP 409)."""


@dataclass(slots=True)
class StateSummary:
    id: str
    labels: list[str]
    tokens: int
    bytes: int
    created: str
    source: str = ""
    error: str | None = None  # set when the file does not read as a state
    extra: dict = field(default_factory=dict)
    quarantine: dict | None = None  # set while a load's reader refusal keeps it quarantined (reason, since, refused)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        d["quarantined"] = d["quarantine"] is not None
        if d["quarantine"] is None:
            del d["quarantine"]
        return d


class StateStore:
    """`<state_dir>/<id>.upc`. Every id goes through `path_for`, which checks it and checks that
    the resolved path stays directly inside the folder.

    `embedded`: the states of the model's GGUF file (`embedded_in`, its name), by id, as the `.upc`
    files `kite.store.cached_states` made of them. They are listed and answered first (a folder file
    of the same id is not reached) and cannot be replaced or deleted.

    `quarantine`: the states a load's reader refused (kite.serve.quarantine); `usable` refuses them,
    summaries say so."""

    def __init__(self, folder: str | os.PathLike[str], embedded: Mapping[str, Path] | None = None,
                 embedded_in: str = "", shared=None):
        self.shared = shared   # a kite.store.TieredStore: states by content address, fetched into the folder
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.root = self.folder.resolve()
        self.embedded, self.embedded_in = dict(embedded or {}), embedded_in
        self._summaries: dict[str, tuple[tuple, StateSummary]] = {}   # id -> (file version, summary)
        self._lock = threading.Lock()
        self.quarantine = Quarantine()

    def path_for(self, state_id: str) -> Path:
        check_state_id(state_id)
        path = (self.root / f"{state_id}.upc").resolve()
        if path.parent != self.root:  # a symlink or anything else that leads out
            raise BadInput(f"state id {state_id!r}: resolves outside the state store")
        return path

    def existing(self, state_id: str) -> Path:
        if state_id in self.embedded:
            if not self.embedded[state_id].is_file():
                raise StateNotFound(f"state {state_id!r} (embedded in {self.embedded_in}): its extracted copy "
                                    f"{self.embedded[state_id]} is gone; restart the server to extract it again")
            return self.embedded[state_id]
        path = self.path_for(state_id)
        if not path.is_file() and not self.fetch(state_id):
            raise StateNotFound(f"no state {state_id!r} (list them with GET /v1/states)")
        return path

    def usable(self, state_id: str) -> Path:
        """:meth:`existing`, refused at once (StateQuarantined) while the state is quarantined."""
        path = self.existing(state_id)
        self.quarantine.check(state_id)
        return path

    def exists(self, state_id: str) -> bool:
        return state_id in self.embedded or self.path_for(state_id).is_file() or self.fetch(state_id)

    def fetch(self, state_id: str) -> bool:
        """With a shared store: when `state_id` is a content address the store holds, fetch the state
        (verified: checksums and address) into the folder. False when there is no such state (a
        miss, or every copy failed verification: counted in the store's metrics)."""
        from kite.store import is_address

        if self.shared is None or not is_address(state_id):
            return False
        return self.shared.get_file(state_id, self.path_for(state_id)) is not None

    def publish(self, path: Path) -> str | None:
        """With a shared store: put the state at `path` into every tier under its content address.
        A tier that fails is counted in the store's metrics and logged, not raised: the state is in
        the folder and answers requests. Returns the address (None without a store or address)."""
        if self.shared is None:
            return None
        from kite.store import StoreError, Unaddressed

        try:
            report = self.shared.put_file(path)
        except (StoreError, Unaddressed) as exc:
            _log.warning("state %s not stored: %s", path.name, exc)
            return None
        for tier, why in report.failed.items():
            _log.warning("state %s: store tier %s %s", report.id[:16], tier, why)
        return report.id

    def check_writable(self, state_id: str) -> None:
        """StateReadOnly when `state_id` names a state embedded in the model's file."""
        if state_id in self.embedded:
            raise StateReadOnly(f"state {state_id!r} is embedded in {self.embedded_in or 'the model file'} and "
                                f"cannot be replaced or deleted; use another id")

    @staticmethod
    def id_for(document: str, model_fingerprint: str) -> str:
        """A content id: the same document for the same model is the same state."""
        digest = hashlib.sha256(model_fingerprint.encode() + b"\0" + document.encode("utf-8")).hexdigest()
        return f"doc-{digest[:16]}"

    def summary(self, state_id: str) -> StateSummary:
        from kite.upcycle import path_version

        path = self.existing(state_id)
        try:
            key = path_version(path)   # the identity every cache of a state keys on
        except FileNotFoundError:
            raise StateNotFound(f"no state {state_id!r} (list them with GET /v1/states)") from None
        with self._lock:
            hit = self._summaries.get(state_id)
        if hit and hit[0] == key:
            summary = hit[1]
        else:
            summary = _read_summary(state_id, path, key[3])
            if state_id in self.embedded:
                summary.extra["embedded"] = self.embedded_in
            with self._lock:
                self._summaries[state_id] = (key, summary)
        quarantine = self.quarantine.describe(state_id)
        return summary if quarantine is None else replace(summary, quarantine=quarantine)

    def list(self) -> list[StateSummary]:
        out = []
        folder = (p.name.removesuffix(".upc") for p in sorted(self.root.glob("*.upc")))
        for sid in [*self.embedded, *(s for s in folder if s not in self.embedded)]:
            try:
                out.append(self.summary(sid))
            except (BadInput, StateNotFound):
                continue  # a name that is not a valid id (placed by hand) or gone meanwhile
        return out

    def delete(self, state_id: str) -> Path:
        """Remove a state's file (its path returned); StateNotFound when there is none."""
        self.check_writable(state_id)
        path = self.existing(state_id)
        path.unlink()
        with self._lock:
            self._summaries.pop(state_id, None)
        self.quarantine.lift(state_id, "deleted")
        return path


def _read_summary(state_id: str, path: Path, size: int) -> StateSummary:
    from kite.upcycle import StateFile

    try:
        with StateFile(path) as state:
            meta = state.meta
    except (KiteError, OSError, ValueError) as exc:
        return StateSummary(state_id, [], 0, size, "", error=str(exc).splitlines()[0])
    labels = sorted({c["label"] for c in meta.get("clusters", [])})
    raw = meta.get("raw_kv_bytes_fp16") or 0
    return StateSummary(state_id, labels, int(meta.get("n_tokens", 0)), size, meta.get("created_at", ""),
                        source=(meta.get("source") or {}).get("name", ""),
                        extra={"clusters": len(meta.get("clusters", [])),
                               "compression_ratio": round(raw / size, 3) if raw and size else None})
