"""Local disk: a folder of ``<address>.upc`` files, bounded, least recently used first out.

The folder is the index: opening the tier reads every file's header (not its blobs) and keeps
the ids whose recorded address checks out and matches the file's name, so the index survives a
restart and sees files another process wrote. Recency starts from each file's mtime (the time it
was written here) and follows reads within the process; reads do not touch the files (a changed
mtime would give the state a new file version and cost every loader a re-hash).
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from kite.atomic import write_bytes
from kite.errors import BadInput, KiteError
from kite.shortid import apart
from kite.store.tier import ObjectStat, Tier, TierError, TierURL, register_tier
from kite.upcycle import StateFile, check_address, is_address


@register_tier
class DiskTier(Tier):
    """``file:///path?max=50GB``. ``rejected``: files of the folder left out of the index, and why
    (a header that does not read, an address that does not check out or is not the file's name)."""

    scheme = "file"

    def __init__(self, folder: str | os.PathLike[str], name: str = "file", write: str = "through",
                 max_bytes: int | None = None, create: bool = True, tenant: str | None = None):
        super().__init__(name, write, max_bytes)
        self.folder = Path(folder).expanduser()
        # create False (a store opened to read): the tier's own folder is not made here (open_tier
        # refused a missing one), and a tenant's part whose folder is missing is empty until a put
        self.create, self.tenant = create, tenant
        if create:
            self._make_folder()
        self._index: dict[str, list] = {}   # id -> [bytes, last use (s), mtime_ns]
        self.rejected: dict[str, str] = {}          # file stem -> why it is not in the index
        self._rejected_at: dict[str, int] = {}      # file stem -> the mtime_ns it was judged at
        self._lock = threading.Lock()
        self.refresh()

    @classmethod
    def from_url(cls, name: str, url: TierURL, write: str, max_bytes: int | None) -> "DiskTier":
        return cls(cls._location(url), name, write, max_bytes)

    @staticmethod
    def _location(url: TierURL) -> str:
        location = url.netloc + url.path
        if not location:
            raise BadInput(f"store URL {url.text!r}: file:// needs a folder (file:///abs/path or file://~/path)")
        return location

    @classmethod
    def absent(cls, url: TierURL) -> str | None:
        folder = Path(cls._location(url)).expanduser()
        if folder.is_dir():
            return None
        return f"folder {folder} does not exist" if not folder.exists() else f"{folder} is not a folder"

    def _lazy(self) -> bool:
        """A tenant's part of a store opened to read: its folder is made by the first put, not before."""
        return not self.create and self.tenant is not None

    def _make_folder(self, lazy: bool = False) -> None:
        """The tier's folder made (BadInput when it cannot be); ``lazy``: a tenant's folder made by a put,
        only inside the store's folder that is still there (TierError otherwise)."""
        try:
            if lazy:
                self.folder.parent.mkdir(exist_ok=True)   # <store>/tenants
                self.folder.mkdir(exist_ok=True)
            else:
                self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if lazy:
                raise TierError(self.name, "put", f"{self.folder}: {exc.strerror or exc}") from None
            raise BadInput(f"store tier {self.name}: cannot use folder {self.folder}: {exc.strerror}") from None

    def _path(self, state_id: str) -> Path:
        if not is_address(state_id):
            raise BadInput(f"{state_id[:80]!r} is not a state address (64 hex digits)")
        return self.folder / f"{state_id}.upc"

    def refresh(self) -> None:
        """Bring the index in step with the folder: headers of new files read, gone files dropped."""
        try:
            names = {p.name[:-4]: p for p in self.folder.iterdir() if p.name.endswith(".upc")}
        except FileNotFoundError as exc:
            if not self._lazy():
                raise TierError(self.name, "list", exc.strerror or str(exc)) from None
            names = {}   # a tenant's folder not made yet (the store was opened to read): no states
        except OSError as exc:
            raise TierError(self.name, "list", exc.strerror or str(exc)) from None
        with self._lock:
            for gone in set(self._index) - set(names):
                del self._index[gone]
        for stem, path in names.items():
            try:
                st = path.stat()
            except OSError:
                continue
            with self._lock:
                known = self._index.get(stem)
                if known is not None and known[2] == st.st_mtime_ns and known[0] == st.st_size:
                    continue
                if self._rejected_at.get(stem) == st.st_mtime_ns:
                    continue
            why = self._check_header(stem, path)
            with self._lock:
                if why is None:
                    self._index[stem] = [st.st_size, st.st_mtime_ns / 1e9, st.st_mtime_ns]
                    self.rejected.pop(stem, None)
                    self._rejected_at.pop(stem, None)
                else:
                    self._index.pop(stem, None)
                    self.rejected[stem], self._rejected_at[stem] = why, st.st_mtime_ns

    @staticmethod
    def _check_header(stem: str, path: Path) -> str | None:
        if not is_address(stem):
            return "the name is not a state address"
        try:
            with StateFile(path) as sf:
                addr = check_address(sf.meta, sf.format_version, str(path))
        except (KiteError, OSError, ValueError) as exc:
            return str(exc).splitlines()[0]
        if addr is None:
            return "an unaddressed state"
        if addr != stem:
            holds, name = apart(addr, stem, 16)
            return f"holds state {holds}..., not {name}..."
        return None

    def get(self, state_id: str) -> bytes | None:
        path = self._path(state_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            with self._lock:
                self._index.pop(state_id, None)
            return None
        except OSError as exc:
            raise TierError(self.name, "get", f"{path}: {exc.strerror or exc}") from None
        with self._lock:
            entry = self._index.get(state_id)
            if entry is None:
                st = path.stat()
                entry = self._index[state_id] = [len(data), 0.0, st.st_mtime_ns]
            entry[1] = _now()
        return data

    def put(self, state_id: str, data: bytes) -> bool:
        path = self._path(state_id)
        if self.max_bytes is not None:
            if len(data) > self.max_bytes:
                return False
            self._make_room(len(data), state_id)
        if self._lazy() and not self.folder.is_dir():
            self._make_folder(lazy=True)
        try:
            write_bytes(path, bytes(data))
            st = path.stat()
        except OSError as exc:
            why = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
            raise TierError(self.name, "put", f"{path}: {why}") from None
        with self._lock:
            self._index[state_id] = [st.st_size, _now(), st.st_mtime_ns]
            self.rejected.pop(state_id, None)
            self._rejected_at.pop(state_id, None)
        return True

    def _make_room(self, need: int, keep: str) -> None:
        with self._lock:
            entries = sorted(((e[1], i, e[0]) for i, e in self._index.items() if i != keep))
            total = sum(e[0] for i, e in self._index.items() if i != keep)
        for _, victim, size in entries:
            if total + need <= self.max_bytes:
                break
            if self.delete(victim):
                total -= size
                self.evictions += 1

    def delete(self, state_id: str) -> bool:
        path = self._path(state_id)
        with self._lock:
            self._index.pop(state_id, None)
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise TierError(self.name, "delete", f"{path}: {exc.strerror or exc}") from None

    def ids(self) -> list[str]:
        self.refresh()
        with self._lock:
            return sorted(self._index)

    def stat(self, state_id: str) -> ObjectStat | None:
        with self._lock:
            entry = self._index.get(state_id)
        if entry is None:
            if not self._path(state_id).is_file():
                return None
            self.refresh()
            with self._lock:
                entry = self._index.get(state_id)
            if entry is None:
                return None
        return ObjectStat(state_id, entry[0], entry[1])

    def path_of(self, state_id: str) -> Path | None:
        """The file holding the state, when this tier holds it (for loaders that read by path)."""
        path = self._path(state_id)
        return path if path.is_file() else None

    def tenant_part(self, tag: str) -> "DiskTier":
        """The tenant's states in ``<folder>/tenants/<tag>/`` (a folder of their own, bound of its own;
        not made before a state is written there when this tier was opened not to create)."""
        part = DiskTier(self.folder / "tenants" / tag, self.name, self.write, self.max_bytes, self.create, tag)
        part._evicted = self._evicted
        return part

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._index), sum(e[0] for e in self._index.values())

    def describe(self) -> str:
        return f"file://{self.folder}" + (f"?max={self.max_bytes}" if self.max_bytes else "")


def _now() -> float:
    import time

    return time.time()
