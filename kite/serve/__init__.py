"""`kite serve`: one model behind an HTTP API — OpenAI-style completions and chat with a `kite`
field naming a state or a document to upcycle, `/v1/states`, admin endpoints for the rules,
Prometheus `/metrics` and `/healthz`. See docs/serving.md.

Names load on first use, so `kite.serve.client` (the admin client the CLI uses) needs only httpx,
not the server's stack (fastapi, uvicorn, prometheus-client).
"""

from __future__ import annotations

import importlib

_EXPORTS = {"create_app": "kite.serve.app", "BackgroundServer": "kite.serve.server", "run": "kite.serve.server",
            "bind_socket": "kite.serve.server",
            "ServeSettings": "kite.serve.settings", "check_state_id": "kite.serve.settings"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kite.serve' has no attribute {name!r}")
