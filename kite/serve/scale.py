"""How `kite serve --replicas` scales: what each replica loads and how many run (no Ray needed to
build or check these; :mod:`kite.serve.replicas` runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kite.errors import BadInput


@dataclass(slots=True)
class ReplicaSpec:
    """What every replica loads: the model, the upcycle config (a path, a dict of an
    UpcycleConfig, or None for the default file), and the server settings (its port is ignored:
    each replica binds a free loopback port)."""

    model: str
    settings: object   # kite.serve.ServeSettings
    upcycle_config: str | dict | None = None
    kept_fraction: float | None = None
    tagger: bool = True
    torch_threads: int = 1
    # each replica keeps its own folder under state_dir/replicas/<replica id> (as replicas on
    # different machines would); states reach the others through the shared store (settings.store_url)
    own_folders: bool = False

    def __post_init__(self) -> None:
        if self.own_folders and not getattr(self.settings, "store_url", None):
            raise BadInput("replicas with folders of their own need a shared store (--store URL / store.url)")


@dataclass(slots=True)
class ScaleSettings:
    """How many replicas: fixed (`replicas`) or autoscaled between `min_replicas` and
    `max_replicas` (Ray Serve's autoscaler, aiming at `target_ongoing` requests per replica)."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing: int = 2
    max_imbalance: int = 4
    stats_period_s: float = 0.5
    max_ongoing: int = 32
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise BadInput(f"--replicas {self.replicas}: at least 1")
        lo, hi = self.min_replicas, self.max_replicas
        if (lo is None) != (hi is None):
            raise BadInput("server.min_replicas and server.max_replicas: give both (autoscaling) or neither")
        if lo is not None and not 0 < lo <= self.replicas <= hi:
            raise BadInput(f"replicas: need 1 ≤ min_replicas ({lo}) ≤ replicas ({self.replicas}) ≤ "
                           f"max_replicas ({hi})")

    @classmethod
    def from_config(cls, cfg, **kw) -> "ScaleSettings":
        """From a `KiteConfig`'s server.replicas, min_replicas, max_replicas, route_max_imbalance."""
        s = cfg.server
        return cls(**{"replicas": s.replicas, "min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
                      "max_imbalance": s.route_max_imbalance, "max_ongoing": max(2, 4 * s.max_batch), **kw})

    @property
    def distributed(self) -> bool:
        """More than one replica, now or after autoscaling."""
        return self.replicas > 1 or (self.max_replicas or 1) > 1

    def deployment_options(self) -> dict:
        if self.min_replicas is None:
            return {"num_replicas": self.replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas, "initial_replicas": self.replicas,
                                       "max_replicas": self.max_replicas,
                                       "target_ongoing_requests": self.target_ongoing}}
