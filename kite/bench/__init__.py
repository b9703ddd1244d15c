"""The benchmark: cases, the methods compared (full prefill, baselines, the fused pipeline),
scoring, the runner, reports, plots, results history and shadow validation."""
