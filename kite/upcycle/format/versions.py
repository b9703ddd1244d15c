"""Which version of a `.upc` file a check was made on, and the checks remembered across processes.

A file's *version* (:func:`file_version`) is its real path plus device, inode, size, mtime and ctime
in ns: an in-place write changes mtime (and ctime, which no user can set back), a replacement by
rename changes the inode; either gives a new version. It is the one identity every cache of a state
keys on (the verified blobs, the loader's tables, the hot tier).

Verified-version records (``KITE_CACHE/upc_verified.json``): which blobs of which version of a file
(plus the header's checksum) had their checksums checked, by the writer that made the file or by a
loader. A loader in any process skips re-hashing those blobs while the file keeps that version.
``StateFile.read`` and ``StateFile.verify`` (``kite upcycle inspect --verify``) never consult them.
``KITE_VERIFY_RECORD=0`` turns them off (nothing read, nothing written).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from kite.atomic import write_text
from kite.paths import cache_dir

_RECORD_LIMIT = 512          # files remembered (the oldest record goes first)
_RECORD_LOCK = threading.Lock()


def records_enabled() -> bool:
    return os.environ.get("KITE_VERIFY_RECORD", "1") not in ("0", "false", "no", "off")


def file_version(fd: int, path: str | os.PathLike[str]) -> tuple:
    """What identifies one version of a file's bytes: real path, device, inode, size, mtime and ctime (ns).

    An in-place write changes mtime (and ctime, which no user can set back), a replacement by rename
    changes the inode: either gives a new version.
    """
    return (os.path.realpath(path),) + _stat_version(fd)


def path_version(path: str | os.PathLike[str]) -> tuple:
    """:func:`file_version` of the file at ``path`` now, without opening it (OSError if it is gone)."""
    return (os.path.realpath(path),) + _fields(os.stat(path))


def _stat_version(fd: int) -> tuple:
    return _fields(os.fstat(fd))


def _fields(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def same_version(fd: int, version: tuple) -> bool:
    """Whether the open file ``fd`` is still ``version`` (a file_version of it): its fstat fields
    only, without resolving the path again (realpath is slow on a busy host)."""
    return _stat_version(fd) == tuple(version[1:])


def _record_file() -> Path:
    return cache_dir() / "upc_verified.json"


def _load_records() -> dict:
    try:
        data = json.loads(_record_file().read_text())
        return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else {"files": {}}
    except (OSError, ValueError):
        return {"files": {}}


def verified_record(version: tuple, header_sum: str) -> set[str] | None:
    """The blob keys recorded as verified for exactly this file version and header (None: no record)."""
    if not records_enabled():
        return None
    rec = _load_records()["files"].get(version[0])
    if not isinstance(rec, dict) or rec.get("version") != list(version[1:]) or rec.get("header") != header_sum:
        return None
    keys = rec.get("keys")
    return set(keys) if isinstance(keys, list) else None


def record_verified(version: tuple, header_sum: str, keys) -> None:
    """Remember that these blobs of this file version checked out (merged with an existing record of
    the same version; a record of another version of the path is replaced). Best effort: a cache
    that cannot be written only costs a re-hash later."""
    if not records_enabled():
        return
    with _RECORD_LOCK:
        data = _load_records()
        files = data["files"]
        old = files.pop(version[0], None)
        keys = set(keys)
        if isinstance(old, dict) and old.get("version") == list(version[1:]) and old.get("header") == header_sum:
            keys |= set(old.get("keys") or [])
        files[version[0]] = {"version": list(version[1:]), "header": header_sum, "keys": sorted(keys)}
        while len(files) > _RECORD_LIMIT:
            files.pop(next(iter(files)))
        try:
            write_text(_record_file(), json.dumps(data, separators=(",", ":")))
        except OSError:
            pass


def forget_record(path: str | os.PathLike[str] | None = None) -> None:
    """Drop the verified-version record of one file (or every record)."""
    with _RECORD_LOCK:
        data = _load_records()
        if path is None:
            if not data["files"]:
                return
            data["files"] = {}
        elif data["files"].pop(os.path.realpath(path), None) is None:
            return
        try:
            write_text(_record_file(), json.dumps(data, separators=(",", ":")))
        except OSError:
            pass
