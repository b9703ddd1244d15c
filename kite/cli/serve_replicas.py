"""`kite serve --replicas N`: start the replicas on Ray Serve, print the endpoint, wait for Ctrl-C."""

from __future__ import annotations

import time

from kite.errors import KiteError


def serve_replicas(out, model: str, settings, scale, ucfg, kept_fraction, ray_address: str | None) -> None:
    """`ucfg`: the (config, path) pair `load_upcycle_config` gave (already checked)."""
    from dataclasses import replace

    try:
        from kite.serve import replicas
    except ModuleNotFoundError as exc:
        raise KiteError(f"kite serve --replicas needs {exc.name}: pip install 'kite[scale]'") from None
    from kite.serve.scale import ReplicaSpec

    cfg, cfg_path = ucfg
    spec = ReplicaSpec(model=model, settings=replace(settings, state_dir=settings.state_dir.resolve(),
                                                     rules_path=settings.rules_path.resolve()),
                       upcycle_config=str(cfg_path.resolve()) if cfg_path else cfg.model_dump(mode="json"),
                       kept_fraction=kept_fraction)
    bounds = (f"autoscaled {scale.min_replicas}-{scale.max_replicas}" if scale.min_replicas is not None
              else f"{scale.replicas}")
    out.print(f"starting {bounds} replicas of {model} on Ray ({ray_address or 'a local head'}) …",
              highlight=False)
    from kite.serve.settings import LOOPBACK

    if settings.host not in LOOPBACK:
        out.print(f"[yellow]warning:[/] binding {settings.host}: the API is reachable from other machines",
                  highlight=False)
    cluster = replicas.start(spec, scale, host=settings.host, port=settings.port, address=ray_address)
    try:
        out.print(f"[bold green]serving[/] {model} on {cluster.url}  replicas {bounds}  states "
                  f"{spec.settings.state_dir}" + (f" + store {settings.store_url}" if settings.store_url else "") +
                  f"  router: state-aware (max imbalance {scale.max_imbalance})  "
                  f"metrics {cluster.url}/metrics (every replica, label replica=)", highlight=False, soft_wrap=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        out.print("stopping replicas …", highlight=False)
    finally:
        replicas.stop(cluster)
