"""What the store checks of every object it reads or is given: the whole container (header,
fields, size, every blob's checksum) and the content address recorded in the header, recomputed
from the header's own fields and compared with the id the object was filed under."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kite.errors import BadInput
from kite.shortid import apart
from kite.upcycle import check_address
from kite.upcycle import format as upc_format


class CorruptState(BadInput):
    """An object that is not a whole, checksum-clean state of the address it was filed under."""


class WrongTenant(BadInput):
    """A state whose address was made for another tenant (or none) than the store it is put into."""


class Unaddressed(BadInput):
    """A state without a content address in its header (written before addresses, or migrated)."""


@dataclass(frozen=True, slots=True)
class StateInfo:
    """A verified state: its address and what its header says of it."""

    id: str
    bytes: int
    n_tokens: int
    model: str
    labels: list[str]
    created_at: str
    source: str
    tenant: str | None = None   # the tag of the tenant its address was made for (kite.tenants); None: none

    def to_dict(self) -> dict:
        return {"id": self.id, "bytes": self.bytes, "n_tokens": self.n_tokens, "model": self.model,
                "labels": self.labels, "created_at": self.created_at, "source": self.source}


def verify_state(data: bytes, expect_id: str | None = None, where: str = "state") -> StateInfo:
    """The state's info when `data` is a whole, clean, addressed state (of `expect_id` when given).
    CorruptState (one line) for anything wrong with its bytes or address; Unaddressed for a clean
    state that records no address."""
    try:
        meta, version = upc_format.check_state_bytes(data, where)
        address = check_address(meta, version, where)
    except BadInput as exc:
        raise CorruptState(str(exc)) from None
    if address is None:
        raise Unaddressed(f"{where}: the state has no content address in its header (made before "
                          f"addresses, or migrated to another model); compress it again with "
                          f"`kite upcycle compress` to store it")
    if expect_id is not None and address != expect_id:
        filed, holds = apart(expect_id, address, 16)
        raise CorruptState(f"{where}: filed under {filed}... but holds state {holds}...")
    return StateInfo(address, len(data), int(meta.get("n_tokens", 0)),
                     (meta.get("fingerprints") or {}).get("combined") or "",
                     sorted({c.get("label", "") for c in meta.get("clusters", [])}), meta.get("created_at", ""),
                     (meta.get("source") or {}).get("name", ""), meta["address"].get("tenant"))


def read_state_file(path: str | Path) -> tuple[bytes, StateInfo]:
    """A `.upc` file's bytes and info, verified whole (BadInput for a file that is missing or bad)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such state file") from None
    except IsADirectoryError:
        raise BadInput(f"{path}: is a folder, not a .upc state") from None
    return data, verify_state(data, where=str(path))
