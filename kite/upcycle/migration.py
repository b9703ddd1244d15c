"""`kite upcycle migrate`: move states to a new model's fingerprint, journaled and resumable.

Which states: those whose combined, model or tokenizer fingerprint the old fingerprint names
(full or short form; each file's plan says which part matched). A fingerprint that names no state
in the folder is an error that lists the fingerprints the folder holds.

Per file: write the new file beside it (header rewritten, blobs copied), rename it into place,
remove the old name, and record each step in `DIR/.kite-migrate.journal` (JSON lines). A run
interrupted anywhere resumes from the journal, or `rollback` puts every finished file back.

A state coded on a regenerator moves it too: the regenerator (found by its fingerprint, as a load
finds it) is copied for the new model (same bases, its model fingerprint and so its own fingerprint
new, kept under ``$KITE_HOME/regenerators``) and the state's header names the copy, so new states
of the new model are coded on the same bases. A regenerator that is not here stays named as it was
(the state loads once it is given), and the file's plan says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kite.errors import BadInput, KiteError
from kite.model.fingerprint import PREFIX, short
from kite.upcycle.codec.regenerator import Regenerator, install, resolve
from kite.upcycle.format.container import StateFile, rewrite_header

JOURNAL = ".kite-migrate.journal"


@dataclass
class FileAction:
    old_path: str
    new_path: str
    action: str  # "migrate" | "skip" | "refuse" | "done" (already migrated by a resumed run)
    reason: str = ""
    matched: str | None = None  # which of the file's fingerprints the old one named: combined | model | tokenizer


@dataclass
class MigrationReport:
    old: str
    new: str
    dry_run: bool
    files: list[FileAction] = field(default_factory=list)
    resumed: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def _matches(fp: str | None, query: str) -> bool:
    return bool(fp) and fp.removeprefix(PREFIX).startswith(query.removeprefix(PREFIX).lower())


MATCH_ORDER = ("combined", "model", "tokenizer")


def matched_part(fps: dict, query: str) -> str | None:
    """Which of a state's fingerprints (combined, model, tokenizer, in that order) `query` names
    (full or short form), or None."""
    return next((part for part in MATCH_ORDER if _matches(fps.get(part), query)), None)


def _check_fp_arg(name: str, value: str) -> str:
    hexpart = value.removeprefix(PREFIX).lower()
    if len(hexpart) < 8 or any(c not in "0123456789abcdef" for c in hexpart):
        raise BadInput(f"--{name} {value}: expected a fingerprint (kite-fp1:<hex> or at least 8 hex digits)")
    return hexpart


def _new_name(path: Path, old_short: str, new_short: str) -> Path:
    return path.with_name(path.name.replace(old_short, new_short)) if old_short in path.name else path


def _journal_lines(folder: Path) -> list[dict]:
    path = folder / JOURNAL
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a torn last line from a crash: everything before it stands
    return out


def _append(folder: Path, record: dict) -> None:
    path = folder / JOURNAL
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def plan_migration(folder: Path, old: str, new: str, new_fps=None, new_geometry=None,
                   force: bool = False) -> MigrationReport:
    """What a migration would do to each .upc file in `folder`."""
    old_hex, new_hex = _check_fp_arg("old-model-fingerprint", old), _check_fp_arg("new-model-fingerprint", new)
    if new_fps is not None and matched_part(new_fps.to_dict(), new_hex) is None:
        raise BadInput(f"--new-model-fingerprint {new} is not the fingerprint of --new-model "
                       f"({short(new_fps.combined)}, or its model or tokenizer fingerprint)")
    if new_fps is not None:
        new_hex = new_fps.combined.removeprefix(PREFIX)  # states record the combined one
    report = MigrationReport(old=old, new=new, dry_run=True)
    seen: dict[str, int] = {}
    for path in sorted(folder.glob("*.upc")):
        try:
            with StateFile(path) as sf:
                meta = sf.meta
        except BadInput as exc:
            report.files.append(FileAction(str(path), str(path), "skip", f"unreadable: {exc}"))
            continue
        fps = meta.get("fingerprints") or {}
        fp = fps.get("combined")
        seen[short(fp or "?")] = seen.get(short(fp or "?"), 0) + 1
        part = matched_part(fps, old_hex)
        old_short = short(fp) if part and fp and short(fp) in path.name else old_hex[:12]
        target = _new_name(path, old_short, new_hex[:12])
        if _matches(fp, new_hex):
            report.files.append(FileAction(str(path), str(path), "skip", "already on the new fingerprint"))
        elif part is None:
            report.files.append(FileAction(str(path), str(path), "skip", f"made by {short(fp or '?')}"))
        elif new_geometry is not None and not _geometry_ok(meta, new_geometry) and not force:
            report.files.append(FileAction(str(path), str(target), "refuse",
                                           "the new model's KV geometry differs (layers, KV heads, head_dim "
                                           "or RoPE); --force to migrate anyway", matched=part))
        else:
            report.files.append(FileAction(str(path), str(target), "migrate",
                                           f"its {part} fingerprint {short(fps[part])} matched", matched=part))
    if not any(f.action != "skip" or f.reason == "already on the new fingerprint" for f in report.files):
        if not seen:
            raise BadInput(f"--upcycle-dir {folder}: no readable .upc states in it")
        held = ", ".join(f"{fp} ({n} file{'s' if n != 1 else ''})" for fp, n in sorted(seen.items()))
        raise BadInput(f"--old-model-fingerprint {old} names no state in {folder} (as combined, model or "
                       f"tokenizer fingerprint); the states there were made by {held}")
    return report


def _geometry_ok(meta: dict, geometry) -> bool:
    from kite.model.geometry import Geometry

    return Geometry.from_dict(meta["model"]["geometry"]).kv_compatible(geometry)


def _new_meta(meta: dict, old: str, new_hex: str, new_fps, new_geometry) -> dict:
    meta = dict(meta)
    previous = meta.get("fingerprints", {})
    if new_fps is not None:
        fps = new_fps.to_dict()
    else:  # only the combined fingerprint is known: parts are checked through it at load
        fps = {"model": None, "tokenizer": None, "adapter": None, "combined": PREFIX + new_hex}
    fps["migrated_from"] = previous.get("combined")
    meta["fingerprints"] = fps
    if new_geometry is not None:
        meta["model"] = {**meta["model"], "geometry": new_geometry.to_dict()}
    meta.setdefault("migrations", []).append({"from": previous.get("combined"), "to": fps["combined"]})
    # the content address named the old model: the moved state is no longer what it says (the new
    # model would compute other K and V), so it becomes unaddressed (a rollback restores it)
    meta.pop("address", None)
    return meta


def migrate(folder: str | Path, old: str, new: str, *, new_fps=None, new_geometry=None,
            force: bool = False, dry_run: bool = False, health=None) -> MigrationReport:
    """Migrate every state of `folder` made by fingerprint `old` to `new` (see module doc)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"--upcycle-dir {folder}: no such folder")
    journal = _journal_lines(folder)
    resumed = bool(journal) and journal[0].get("old") == old and journal[0].get("new") == new
    if journal and not resumed:
        raise KiteError(f"{folder / JOURNAL}: an unfinished migration {journal[0].get('old')} → "
                        f"{journal[0].get('new')} is pending; re-run it to resume, or roll it back "
                        f"(kite upcycle migrate --rollback --upcycle-dir {folder})")
    done = {r["old_path"]: r for r in journal if r.get("step") == "done"}
    report = plan_migration(folder, old, new, new_fps, new_geometry, force)
    report.dry_run, report.resumed = dry_run, resumed
    if resumed:  # files finished before the interruption show up as "already on the new fingerprint"
        for f in report.files:
            for rec in done.values():
                if rec["new_path"] == f.old_path:
                    f.action, f.old_path, f.new_path, f.reason = "done", rec["old_path"], rec["new_path"], "resumed"
    if dry_run:
        return report
    new_hex = (new_fps.combined if new_fps is not None else new).removeprefix(PREFIX).lower()
    # the new model's weights + tokenizer (what a regenerator belongs to); only its combined one
    # when no --new-model was given
    new_base = new_fps.base if new_fps is not None else PREFIX + new_hex
    moved: dict[str, str | None] = {}
    if not journal:
        _append(folder, {"old": old, "new": new})
    for f in report.files:
        if f.action != "migrate":
            continue
        src, dest = Path(f.old_path), Path(f.new_path)
        with StateFile(src) as sf:
            meta = sf.meta
        _append(folder, {"step": "begin", "old_path": str(src), "new_path": str(dest),
                         "old_fingerprints": meta.get("fingerprints"), "old_geometry": meta["model"]["geometry"],
                         "old_regenerator": meta.get("regenerator"), "old_address": meta.get("address")})
        new_meta = _new_meta(meta, old, new_hex, new_fps, new_geometry)
        if meta.get("regenerator"):
            fp = meta["regenerator"]["fingerprint"]
            if fp not in moved:
                moved[fp] = _move_regenerator(fp, new_base)
            if moved[fp] is not None:
                new_meta["regenerator"] = {**meta["regenerator"], "fingerprint": moved[fp]}
                f.reason = (f.reason + "; " if f.reason else "") + f"regenerator {short(fp)} → {short(moved[fp])}"
            else:
                f.reason = (f.reason + "; " if f.reason else "") + (f"regenerator {short(fp)} is not here: the "
                                                                    "state still names it")
        rewrite_header(src, dest, new_meta)
        if dest != src:
            src.unlink(missing_ok=True)
        if health is not None:
            health.reset(src.stem)
            health.reset(dest.stem)
        _append(folder, {"step": "done", "old_path": str(src), "new_path": str(dest)})
    (folder / JOURNAL).unlink(missing_ok=True)
    return report


def _move_regenerator(fingerprint: str, new_base: str) -> str | None:
    """The fingerprint of `fingerprint`'s regenerator copied for the model `new_base` (kept under
    $KITE_HOME/regenerators), or None when that regenerator is not here."""
    try:
        reg = resolve(fingerprint)
    except KiteError:
        return None
    if reg.meta.get("model_fingerprint") == new_base:
        return reg.fingerprint
    meta = {**reg.meta, "model_fingerprint": new_base,
            "migrations": [*reg.meta.get("migrations", []), {"from": reg.fingerprint}]}
    moved = Regenerator(meta, reg.tensors)
    install(moved)
    return moved.fingerprint


def pending_migration(folder: str | Path) -> dict | None:
    """The unfinished migration `folder`'s journal records, None when there is none:
    {"old", "new", "journal" (its path), "done" (states moved to the new fingerprint so far)}."""
    folder = Path(folder)
    journal = _journal_lines(folder)
    if not journal:
        return None
    return {"old": journal[0].get("old"), "new": journal[0].get("new"), "journal": str(folder / JOURNAL),
            "done": sum(r.get("step") == "done" for r in journal)}


def rollback(folder: str | Path) -> MigrationReport:
    """Undo the finished files of an interrupted migration (the journal says which)."""
    folder = Path(folder)
    journal = _journal_lines(folder)
    if not journal:
        raise BadInput(f"{folder}: no migration journal to roll back")
    begun = {r["old_path"]: r for r in journal if r.get("step") == "begin"}
    report = MigrationReport(old=journal[0].get("new"), new=journal[0].get("old"), dry_run=False)
    for old_path, rec in begun.items():
        src, dest = Path(rec["new_path"]), Path(old_path)
        if not src.exists():
            continue  # the interruption came before its rename: the old file is untouched
        with StateFile(src) as sf:
            meta = dict(sf.meta)
        if meta.get("fingerprints", {}).get("combined") == (rec["old_fingerprints"] or {}).get("combined"):
            continue  # the interruption came before this file was rewritten
        meta["fingerprints"] = rec["old_fingerprints"]
        meta["model"] = {**meta["model"], "geometry": rec["old_geometry"]}
        if rec.get("old_regenerator"):
            meta["regenerator"] = rec["old_regenerator"]
        if rec.get("old_address"):
            meta["address"] = rec["old_address"]
        meta["migrations"] = (meta.get("migrations") or [])[:-1]
        rewrite_header(src, dest, meta)
        if dest != src:
            src.unlink(missing_ok=True)
        report.files.append(FileAction(str(src), str(dest), "rolled back"))
    (folder / JOURNAL).unlink(missing_ok=True)
    return report
