"""The keyed digest of a `.upc` header: an HMAC-SHA256 under a shared secret, which a forger who
recomputes every unkeyed digest (blob checksums, content digest, address id, header checksum) still
cannot make (docs/upc-format.md, "Keyed digest").

The header's ``signature`` section is ``{"scheme": "kite-hmac1", "key_id": <16 hex>, "hmac_sha256":
<64 hex>}``: the HMAC of the canonical JSON (sorted keys, compact, ASCII) of ``{"scheme",
"format_version", "header"}``, where ``header`` is the whole header but its ``signature``: the
cluster table and the blob index with every part's checksum (what the ``content`` digest covers),
the content address's fields, the fingerprints, the geometry, the codec settings, everything.
``key_id`` names the key (a hash of it, not the key) so that a state signed under another key is
told from an edited one.

The policy (:class:`SigningPolicy`) comes from the config's ``security.state_key`` and
``security.require_signed`` (file or ``KITE_SECURITY__STATE_KEY`` / ``KITE_SECURITY__REQUIRE_SIGNED``),
read again when the config file or the ``KITE_*`` environment changes; :func:`use_policy` sets it
for a process that does not read the config (a library user, a test).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass

from kite.errors import BadInput

SIGNATURE_SCHEME = "kite-hmac1"
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class SigningPolicy:
    """``key``: the shared secret (None: states are written unsigned and signatures not checked);
    ``require``: refuse a state without a valid keyed digest."""

    key: bytes | None = None
    require: bool = False

    def __repr__(self) -> str:   # never the key
        return f"SigningPolicy(key_id={self.key_id!r}, require={self.require})"

    @property
    def key_id(self) -> str | None:
        return key_id(self.key) if self.key is not None else None

    @property
    def stamp(self) -> tuple:
        """What a cache of checked headers keys on (not the key itself)."""
        return (self.key_id, self.require)


def key_id(key: bytes) -> str:
    """A name of the key that does not give it away: 16 hex digits of a hash of it."""
    return hashlib.sha256(b"kite-state-key-id\0" + key).hexdigest()[:16]


def _body(meta: dict, format_version: int) -> bytes:
    header = {k: v for k, v in meta.items() if k != "signature"}
    body = {"scheme": SIGNATURE_SCHEME, "format_version": format_version, "header": header}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def signature(meta: dict, format_version: int, key: bytes) -> dict:
    """The ``signature`` section of the header ``meta`` (its blob index included) under ``key``."""
    mac = hmac.new(key, _body(meta, format_version), hashlib.sha256).hexdigest()
    return {"scheme": SIGNATURE_SCHEME, "key_id": key_id(key), "hmac_sha256": mac}


def signed(meta: dict, format_version: int, policy: "SigningPolicy | None" = None) -> dict:
    """``meta`` as a writer stores it: a stale ``signature`` dropped, a new one added when the policy
    has a key."""
    policy = policy or signing_policy()
    rest = {k: v for k, v in meta.items() if k != "signature"}
    if policy.key is None:
        return rest
    # signed as a reader will see it: parsed from its JSON (integer keys become strings, tuples lists)
    as_read = json.loads(json.dumps(rest, ensure_ascii=False))
    return {**rest, "signature": signature(as_read, format_version, policy.key)}


def check_signature(meta: dict, format_version: int, where, policy: "SigningPolicy | None" = None) -> bool:
    """BadInput (one line naming ``where``) when the policy has a key and the header's keyed digest
    is malformed or does not match, or the policy requires one and the header has none. Returns
    whether the header's keyed digest was checked and matched."""
    policy = policy or signing_policy()
    sec = meta.get("signature")
    if sec is None:
        if policy.require:
            raise BadInput(f"{where}: unsigned .upc state (its header has no keyed digest, and "
                           f"security.require_signed refuses such states)")
        return False
    if policy.key is None:
        return False   # nothing to check it with: as a reader that does not know the field
    if (not isinstance(sec, dict) or sec.get("scheme") != SIGNATURE_SCHEME
            or not isinstance(sec.get("hmac_sha256"), str) or not _HEX64.fullmatch(sec["hmac_sha256"])):
        raise BadInput(f"{where}: corrupt .upc state (its keyed digest is malformed)")
    want = signature(meta, format_version, policy.key)
    if hmac.compare_digest(want["hmac_sha256"], sec["hmac_sha256"]):
        return True
    theirs = sec.get("key_id")
    if isinstance(theirs, str) and theirs != want["key_id"]:
        raise BadInput(f"{where}: signed with another key (key id {theirs[:16]}, this KITE's "
                       f"security.state_key is {want['key_id']})")
    raise BadInput(f"{where}: its keyed digest does not match (the state was forged or changed after it "
                   f"was signed)")


# ------------------------------------------------------------------ the policy

_set: SigningPolicy | None = None
_loaded: tuple[tuple, SigningPolicy] | None = None


def use_policy(policy: SigningPolicy | None) -> None:
    """Use ``policy`` in this process whatever the config says; None: read the config again."""
    global _set
    _set = policy


def policy_from(state_key: str | None, require_signed: bool, where: str = "config") -> SigningPolicy:
    """The policy of the two config values (BadInput when signatures are required without a key)."""
    if require_signed and not state_key:
        raise BadInput(f"{where}: security.require_signed is on but security.state_key is not set "
                       f"(set KITE_SECURITY__STATE_KEY or `kite config set security.state_key ...`)")
    return SigningPolicy(state_key.encode() if state_key else None, bool(require_signed))


def signing_policy() -> SigningPolicy:
    """The policy in force: :func:`use_policy`'s, else the config's (read once per config file
    version and ``KITE_*`` environment; without a config file or a ``KITE_SECURITY__*`` variable,
    no key)."""
    global _loaded
    if _set is not None:
        return _set
    from kite.paths import config_path

    path = config_path()
    try:
        st = path.stat()
        stamp: tuple = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = (str(path), None)
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("KITE_")))
    stamp = (stamp, env)
    if _loaded is not None and _loaded[0] == stamp:
        return _loaded[1]
    if stamp[0][1] is None and not any(k.startswith("KITE_SECURITY__") for k, _ in env):
        policy = SigningPolicy()
    else:
        from kite.config import load_config

        sec = load_config(path).security
        policy = policy_from(sec.state_key, sec.require_signed)
    _loaded = (stamp, policy)
    return policy
