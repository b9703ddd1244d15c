"""Tenants: who a state belongs to when one store (or one server) holds the states of several.

A tenant is a name (``acme``, ``team-7``: 1-64 of letters, digits, ``.``, ``_``, ``-``, starting with a
letter or a digit). What the rest of KITE uses is its *tag*: the first 32 hex digits of
sha256(``kite-tenant1`` NUL name). The tag is salted into a state's content address
(:mod:`kite.upcycle.address`: the same document made for two tenants has two addresses) and names
the tenant's part of every store tier (:mod:`kite.store.tenants`), so one tenant can neither find,
list nor load another's states. No tenant (None) is what KITE did before tenants: the same
addresses, the same keys.

A tenant name is a namespace, not a secret: whoever holds a store's credentials reaches every
tenant's part of it. Between the callers of one server, the server's API keys decide the tenant
(docs/serving.md, "Tenants").
"""

from __future__ import annotations

import hashlib
import re

from kite.errors import BadInput

TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TAG_SCHEME = b"kite-tenant1\0"
TAG_HEX = 32


def check_tenant(name: str | None, what: str = "--tenant") -> str | None:
    """The tenant name, checked (None: no tenant). BadInput, one line, for an empty or malformed one."""
    if name is None:
        return None
    if not isinstance(name, str) or not TENANT_RE.fullmatch(name):
        shown = repr(name)[:80] if isinstance(name, str) else type(name).__name__
        why = "empty" if name == "" else "malformed"
        raise BadInput(f"{what} {shown}: {why}; a tenant is 1-64 of A-Z a-z 0-9 . _ - starting with a letter "
                       f"or a digit")
    return name


def tenant_tag(name: str | None) -> str | None:
    """The tenant's tag (32 hex digits) that addresses and store keys carry; None for no tenant."""
    if check_tenant(name, "tenant") is None:
        return None
    return hashlib.sha256(TAG_SCHEME + name.encode()).hexdigest()[:TAG_HEX]


def is_tag(text: object) -> bool:
    """Whether `text` has the form of a tenant tag."""
    return isinstance(text, str) and len(text) == TAG_HEX and all(c in "0123456789abcdef" for c in text)
