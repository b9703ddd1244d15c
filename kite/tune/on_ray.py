"""`kite tune auto --ray`: a grid's points measured at once on a Ray cluster's workers.

Each point is one Ray task running :func:`kite.bench.runner.run_bench` with the point's settings
(the same :func:`kite.tune.point.bench_settings` a local sweep uses, and a fresh health store, as
locally); the sweep then judges the points in grid order as a local sweep does. Only a grid: Optuna
proposes each point from the results before it. Timings differ from a local sweep (other processes
share the machine); the figures that do not measure time do not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict


def _run_point(settings: dict, threads: int | None) -> dict:
    from kite.bench.runner import BenchSettings, run_bench

    if threads:
        import torch

        torch.set_num_threads(threads)
    return run_bench(BenchSettings(**settings))


def measure_grid_ray(points: list[tuple[str, dict]], settings_of: Callable[[str, dict], object], *,
                     address: str | None = None, threads: int | None = 1,
                     progress: Callable[[str, int, int], None] | None = None) -> dict[str, dict]:
    """{point id: its bench result} for `points` ((id, params) pairs); `settings_of(id, params)` gives
    a point's BenchSettings."""
    import ray

    from kite.ray_session import connect

    started = connect(address)
    try:
        task = ray.remote(num_cpus=1)(_run_point)
        refs = {task.remote(asdict(settings_of(pid, params)), threads): pid for pid, params in points}
        out: dict[str, dict] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            out[refs[ready[0]]] = ray.get(ready[0])
            if progress:
                progress("points on ray", len(out), len(refs))
        return out
    finally:
        if started:
            ray.shutdown()
