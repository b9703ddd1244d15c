"""PNG plots of a bench result: quality against compression per method, and latency bars."""

from __future__ import annotations

from pathlib import Path


def write_plots(result: dict, folder: str | Path) -> list[str]:
    """quality_vs_compression.png and latency.png in `folder`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kite.atomic import atomic_writer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    overall = {m: f for m, f in result["summary"]["overall"].items() if f}
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, f in overall.items():
        x = f.get("compression_ratio") or 1.0
        for ax, key in zip(axes, ("f1", "ppl_delta")):
            if f.get(key) is not None:
                ax.scatter([x], [f[key]], s=50)
                ax.annotate(name, (x, f[key]), textcoords="offset points", xytext=(5, 5))
    axes[0].set(xlabel="compression vs raw fp16 KV (×)", ylabel="answer F1", title="F1 vs compression")
    axes[1].set(xlabel="compression vs raw fp16 KV (×)", ylabel="PPL Δ vs full prefill",
                title="reference PPL Δ vs compression")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(_save(fig, folder / "quality_vs_compression.png", atomic_writer))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(overall)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [overall[n]["ttft_ms"] or 0 for n in names], 0.4, label="TTFT")
    ax.bar([x + 0.2 for x in xs], [overall[n]["avg_latency_ms"] or 0 for n in names], 0.4, label="latency")
    ax.set_xticks(list(xs), names)
    ax.set(ylabel="ms (mean per case)", title=f"latency per method ({result['machine'].get('device')})")
    ax.legend()
    fig.tight_layout()
    paths.append(_save(fig, folder / "latency.png", atomic_writer))
    plt.close(fig)
    return paths


def _save(fig, path: Path, atomic_writer) -> str:
    with atomic_writer(path) as fh:
        fig.savefig(fh, format="png", dpi=110)
    return str(path)
