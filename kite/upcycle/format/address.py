"""The content address a state's header records, and its check: the id recomputed from the
header's own fields (:func:`check_address`), run whenever a state is opened. How an address is
made from a document, a model and settings is :mod:`kite.upcycle.address`."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from kite.errors import BadInput
from kite.shortid import apart
from kite.tenants import is_tag

SCHEME = "kite-addr1"
ADDRESS_RE = re.compile(r"[0-9a-f]{64}")


def is_address(text: str) -> bool:
    """Whether `text` has the form of a content address (64 lowercase hex digits)."""
    return isinstance(text, str) and ADDRESS_RE.fullmatch(text) is not None


def canonical(obj: Any) -> bytes:
    """The one byte encoding hashed: JSON, sorted keys, compact, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@dataclass(frozen=True, slots=True)
class Address:
    """The fields an address is computed from, and the id (``id``, 64 hex digits)."""

    format_version: int
    model: str
    tokens_sha256: str
    settings: dict
    regenerator: str | None
    # the tenant's tag (kite.tenants.tenant_tag) the state was made for; None: no tenant, and then the
    # field is neither hashed nor written, so untenanted addresses and headers are as before tenants
    tenant: str | None = None

    def fields(self) -> dict:
        body = asdict(self)
        if body["tenant"] is None:
            del body["tenant"]
        return body

    @property
    def id(self) -> str:
        body = {"scheme": SCHEME, **self.fields()}
        return hashlib.sha256(canonical(body)).hexdigest()

    def to_header(self) -> dict:
        """The header section: the fields, the scheme and the id."""
        return {"scheme": SCHEME, **self.fields(), "id": self.id}


class AddressMismatch(BadInput):
    """A state's recorded address does not match what its own header says."""


def check_address(meta: dict, format_version: int, where: str = "state") -> str | None:
    """The state's address recomputed from its header `meta` (None: an unaddressed state).

    AddressMismatch (one line) when the recorded id is not the hash of the recorded fields, or the
    fields disagree with the rest of the header (model fingerprint, regenerator, format version)."""
    sec = meta.get("address")
    if sec is None:
        return None
    if not isinstance(sec, dict) or sec.get("scheme") != SCHEME:
        scheme = sec.get("scheme") if isinstance(sec, dict) else type(sec).__name__
        raise AddressMismatch(f"{where}: address section of unknown scheme {str(scheme)[:40]!r}")
    try:
        addr = Address(sec["format_version"], sec["model"], sec["tokens_sha256"], sec["settings"],
                       sec["regenerator"], sec.get("tenant"))
        if addr.tenant is not None and not is_tag(addr.tenant):
            raise ValueError(f"tenant {str(addr.tenant)[:40]!r} is not a tenant tag")
        recomputed = addr.id
    except (KeyError, TypeError, ValueError) as exc:
        raise AddressMismatch(f"{where}: malformed address section ({exc})") from None
    if sec.get("id") != recomputed:
        recorded, computed = apart(str(sec.get("id")), recomputed, 16)
        raise AddressMismatch(f"{where}: recorded address {recorded}... is not the hash of its "
                              f"fields ({computed}...)")
    combined = (meta.get("fingerprints") or {}).get("combined")
    if addr.model != combined:
        named, header = apart(str(addr.model), str(combined), 15)
        raise AddressMismatch(f"{where}: address names model {named}, the header {header}")
    regen = (meta.get("regenerator") or {}).get("fingerprint")
    if addr.regenerator != regen:
        raise AddressMismatch(f"{where}: address names regenerator {addr.regenerator}, the header {regen}")
    weights = meta.get("layer_weights")
    weights = weights.get("fingerprint") if isinstance(weights, dict) else weights
    named = addr.settings.get("layer_weights") if isinstance(addr.settings, dict) else None
    if named != weights:
        raise AddressMismatch(f"{where}: address names layer weights {str(named)[:80]}, the header {str(weights)[:80]}")
    if addr.format_version != format_version:
        raise AddressMismatch(f"{where}: address names format version {addr.format_version}, the file is "
                              f"{format_version}")
    if meta.get("n_tokens") != (meta.get("source") or {}).get("tokens", meta.get("n_tokens")):
        raise AddressMismatch(f"{where}: token counts disagree in the header")
    return recomputed
