"""Compress through the store: a document whose state the store already holds is not compressed
again; a new state is stored under its address after it is written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kite.store.tiered import PutReport, TieredStore


@dataclass
class StoredCompress:
    """What compress-through-the-store did: the address, whether it compressed (False: the state
    came from tier ``found_in``), the compression's result and where the put went."""

    address: str
    recompressed: bool
    found_in: str | None = None
    result: object | None = None        # kite.upcycle.CompressResult when recompressed
    put: PutReport | None = None

    def to_dict(self) -> dict:
        return {"address": self.address, "recompressed": self.recompressed, "found_in": self.found_in,
                "put": None if self.put is None else self.put.to_dict()}


def compress_to_store(pipe, store: TieredStore, text: str, output: str | Path, *, source_name: str = "-",
                      progress=None, ids: list[int] | None = None) -> StoredCompress:
    """Write the state of `text` (or `ids`) to `output`: fetched (verified) from `store` when a tier
    holds its address (made for the store's tenant, :meth:`TieredStore.for_tenant`), else compressed
    by `pipe` and then put into every tier (a tier's failure is in ``put``; a put no tier took
    raises StoreError)."""
    address = pipe.address_of(text, ids, tenant=store.tenant_name).id
    fetched = store.fetch_file(address, output) if store.where(address) else None
    if fetched is not None:
        return StoredCompress(address, False, found_in=fetched[1])
    result = pipe.compress(text, output, source_name=source_name, progress=progress, ids=ids,
                           tenant=store.tenant_name)
    report = store.put_file(output)
    store.flush()
    return StoredCompress(address, True, result=result, put=report)

