"""State ids: the names states go by in a server's store and inside a GGUF file (`kite.upc.<id>`)."""

from __future__ import annotations

import re

from kite.errors import BadInput

_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def check_state_id(state_id: str) -> str:
    """A state id is a plain name: letters, digits, `.`, `_`, `-`, at most 128, not starting with
    a dot (no `..`, no hidden temp files). Raises BadInput otherwise."""
    if not isinstance(state_id, str) or not _ID.fullmatch(state_id) or state_id.startswith("."):
        raise BadInput(f"state id {str(state_id)[:80]!r}: expected 1-128 of A-Z a-z 0-9 . _ - "
                       "(not starting with '.')")
    return state_id
