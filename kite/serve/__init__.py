"""`kite serve`: one model behind an HTTP API — OpenAI-style completions and chat with a `kite`
field naming a state or a document to upcycle, `/v1/states`, admin endpoints for the rules,
Prometheus `/metrics` and `/healthz`. See docs/serving.md."""

from kite.serve.app import create_app
from kite.serve.server import BackgroundServer, run
from kite.serve.settings import ServeSettings, check_state_id

__all__ = ["BackgroundServer", "ServeSettings", "check_state_id", "create_app", "run"]
