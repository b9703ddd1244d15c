"""Joining Ray: an existing cluster at an address, or a local head with a bounded number of CPUs
(`kite serve --replicas`, `kite bench run --ray`, `kite tune auto --ray`).

KITE's own HTTP endpoints bind 127.0.0.1; Ray's internal services (GCS, raylet, workers) listen
on the machine's interfaces whatever is asked (Ray resolves 127.0.0.1 to the node's reachable
address), protected by Ray's token authentication (on by default since Ray 2.5x). No dashboard."""

from __future__ import annotations

import os

from kite.errors import KiteError


def kite_env() -> dict[str, str]:
    """The KITE_* environment (KITE_HOME, KITE_CACHE, the admin token ...) Ray's workers run with:
    the same as the process that starts them."""
    return {k: v for k, v in os.environ.items() if k.startswith("KITE_")}


def connect(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Ray up in this process; True when this call started a local head (stop it with `ray.shutdown`)."""
    try:
        import ray
    except ModuleNotFoundError:
        raise KiteError("this needs Ray: pip install 'kite[scale]'") from None
    if ray.is_initialized():
        return False
    env = {"env_vars": kite_env()}
    if address:
        try:
            ray.init(address=address, log_to_driver=False, runtime_env=env)
        except ConnectionError as exc:
            raise KiteError(f"Ray at {address}: {str(exc).splitlines()[0]}") from None
        return False
    ray.init(num_cpus=num_cpus or min(os.cpu_count() or 1, 4), include_dashboard=False, log_to_driver=False,
             runtime_env=env)
    return True
