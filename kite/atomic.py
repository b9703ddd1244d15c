"""Invariant 4: every file KITE writes goes to a temporary name, is fsynced, then renamed.

The temporary file is ``.NAME.XXXXXXXX.tmp`` beside the target (``XXXXXXXX``: tempfile's eight
random characters). Its writer holds an exclusive ``flock`` on it from creation until after the
rename, and the kernel drops that lock when the writer dies, SIGKILL included. A write to NAME
first removes the *stale* temp files of NAME: those no process holds the lock of and that were last
modified before this process started (a temp file made a moment ago by another writer that has not
taken its lock yet is never one of them). Another tool's files never match the pattern.

Folders: the target's folder must exist, except under ``KITE_HOME`` and ``KITE_CACHE`` (config,
caches, results), which are made as needed. Commands check their output paths up front with
:func:`check_output` (``--mkdir`` makes a missing folder).

Permissions: a new file gets ``0666 & ~umask``, as ``open()`` would give it; a file written over
keeps the permission bits it had (a config chmod-ed 0600 stays 0600).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from kite.errors import BadInput
from kite.paths import cache_dir, kite_home

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so stale temp files are left alone
    fcntl = None

# when this process started, as near as a module can tell (it is loaded before any write)
_STARTED = time.time()


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a binary temp file beside `path`; on clean exit fsync and rename it over `path`.

    On an exception the temp file is removed and `path` is left as it was. The folder of `path`
    must exist (BadInput otherwise) unless it lies under KITE_HOME or KITE_CACHE.
    """
    with _temp_beside(path) as (fh, _tmp):
        yield fh


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """For a writer that opens a path itself (the `gguf` package's GGUFWriter): yields the path of
    the temp file beside `path`, which the writer writes (opening it again writes the same file,
    whose lock stays held); on clean exit the file is fsynced and renamed over `path`, as
    :func:`atomic_writer` does. The writer must have closed the file when the block ends."""
    with _temp_beside(path) as (_fh, tmp):
        yield Path(tmp)


@contextlib.contextmanager
def _temp_beside(path: str | os.PathLike[str]) -> Iterator[tuple[BinaryIO, str]]:
    target = Path(path)
    check_output(target)
    remove_stale_temps(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            os.fchmod(fh.fileno(), _mode_for(target))
            yield fh, tmp
            fh.flush()
            os.fsync(fh.fileno())
            # renamed while still open and locked: no cleaner can take it for stale in between
            os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_writer(path) as fh:
        fh.write(data)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def check_output(path: str | os.PathLike[str], mkdir: bool = False, flag: str | None = None) -> Path:
    """`path` as an output file: not a folder, and its folder exists (made when `mkdir`, or when it
    lies under KITE_HOME or KITE_CACHE), else BadInput naming `flag` and what is wrong. Returns `path`
    as a Path."""
    target = Path(path)
    name = f"{flag} {path}" if flag else str(path)
    if target.is_dir():   # refused now, not after the work that was to be written there
        raise BadInput(f"{name}: is a folder; name the file to write")
    parent = target.parent
    if parent.is_dir():
        return target
    if parent.exists():
        raise BadInput(f"{name}: {parent} is not a folder")
    if mkdir or _under_kite_folders(parent):
        parent.mkdir(parents=True, exist_ok=True)
        return target
    hint = "; give --mkdir to create it" if flag else ""
    raise BadInput(f"{name}: the folder {parent} does not exist{hint}")


def check_output_folder(folder: str | os.PathLike[str], mkdir: bool = False, flag: str | None = None) -> Path:
    """`folder` as an output folder (files are written into it): it exists, or its own folder does
    (it is then made when first written to), or `mkdir` makes it now; else BadInput as for
    :func:`check_output`. Returns `folder` as a Path."""
    folder = Path(folder)
    if folder.is_dir():
        return folder
    if folder.exists():
        raise BadInput(f"{flag + ' ' if flag else ''}{folder}: not a folder")
    check_output(folder, mkdir, flag)
    if mkdir:
        folder.mkdir(exist_ok=True)
    return folder


def _under_kite_folders(folder: Path) -> bool:
    here = Path(os.path.abspath(folder))
    for root in (kite_home(), cache_dir()):
        root = Path(os.path.abspath(root))
        if here == root or root in here.parents:
            return True
    return False


def temp_pattern(target: str | os.PathLike[str]) -> re.Pattern[str]:
    """The names of `target`'s temp files (tempfile.mkstemp's eight characters between)."""
    return re.compile(rf"\.{re.escape(Path(target).name)}\.[a-z0-9_]{{8}}\.tmp")


def remove_stale_temps(target: str | os.PathLike[str]) -> list[Path]:
    """Remove `target`'s stale temp files (see the module doc); returns the paths removed. Best
    effort: a file that cannot be checked or removed is left."""
    if fcntl is None:
        return []
    target = Path(target)
    pattern = temp_pattern(target)
    try:
        names = [n for n in os.listdir(target.parent) if pattern.fullmatch(n)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = target.parent / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_mtime >= _STARTED:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its writer is alive
            with contextlib.suppress(OSError):
                if os.stat(path, follow_symlinks=False).st_ino == st.st_ino:  # still that file
                    os.unlink(path)
                    removed.append(path)
        finally:
            os.close(fd)
    return removed


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it, and put it back at once
    os.umask(mask)
    return mask


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666 & ~current_umask()


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
