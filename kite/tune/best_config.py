"""The winning point as a KITE config file (`kite config validate` accepts it), with why it won
and which points broke which constraint in its comments, and beside it the files for what the
KITE config has no key for: the upcycle config carrying the point's precision / clusters / span
bounds (`NAME.upcycle.yaml`) and the rule file carrying its thresholds (`NAME.rules.yaml`, named by
the config's `yoco.rules_file`). Every file is written atomically."""

from __future__ import annotations

from pathlib import Path

from kite.tune.point import COMPRESSION_KEYS, point_ratio
from kite.tune.judge import params_text
from kite.tune.rule_params import PREFIX


def companion(output: Path, kind: str) -> Path:
    """`best_config.yaml` → `best_config.upcycle.yaml` / `best_config.rules.yaml`."""
    return output.with_name(f"{output.stem}.{kind}{output.suffix or '.yaml'}")


def write_best_config(doc: dict, output: str | Path, cfg, cfg_path: Path | None) -> list[str]:
    """Write the best point of a judged results document (it must have one). Returns the paths
    written, the config first."""
    import yaml

    from kite.atomic import write_text
    from kite.tune.point import variant_data

    output = Path(output)
    best = doc["best"]
    params = best["params"]
    record = next(p for p in doc["points"] if p["id"] == best["id"])
    written: list[str] = []
    features: dict = {}
    notes: list[str] = []
    ratio = point_ratio(params)
    if ratio is not None:
        features["upcycle_compression_ratio"] = round(1.0 / ratio, 6)
        notes.append(f"upcycle_compression_ratio {features['upcycle_compression_ratio']:g} = --ratio {ratio:g}")
    elif "precision" in params:
        # a fraction set here would win over the precision of the upcycle config below
        features["upcycle_compression_ratio"] = None
        notes.append("upcycle_compression_ratio null: the precision in the upcycle config below decides a state's size")
    if "yoco_min_hit_gain" in params:
        features["yoco_min_hit_gain"] = float(params["yoco_min_hit_gain"])
    data: dict = {"features": features} if features else {}
    compression = {k: params[k] for k in COMPRESSION_KEYS if k in params}
    if compression:
        up = companion(output, "upcycle")
        text = (f"# kite tune: the upcycle config of the best point ({params_text(compression)}); made from "
                f"{cfg_path or 'the default upcycle config'}\n"
                f"# use: kite upcycle compress --config {up.name} ...; kite bench run --upcycle-config {up.name}\n"
                + yaml.safe_dump(variant_data(cfg, cfg_path, compression), sort_keys=False, allow_unicode=True,
                                 width=1000))
        write_text(up, text)
        written.append(str(up))
        notes.append(f"{', '.join(compression)}: in {up.name} (the KITE config has no key for them)")
    if any(k.startswith(PREFIX) for k in params):
        rules = companion(output, "rules")
        write_text(rules, Path(record["rules"]).read_text(encoding="utf-8"))
        written.append(str(rules))
        data["yoco"] = {"rules_file": str(rules.resolve())}
        notes.append(f"yoco.rules_file: {rules.name}, the rule file with "
                     + ", ".join(f"{k} = {v:g}" for k, v in params.items() if k.startswith(PREFIX)))
    body = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000) if data else "{}\n"
    write_text(output, header(doc, notes) + body)
    return [str(output), *written]


def header(doc: dict, notes: list[str]) -> str:
    """The comment block: what was swept, why the best point won, what each point broke."""
    best = doc["best"]
    ctx = doc["context"]
    lines = [f"kite tune auto: the best of {len(doc['points'])} points ({doc['search']['kind']} search) on "
             f"{ctx['cases']}, model {ctx['model'] or 'model.default'}, {doc['finished_at']}",
             f"best point {best['id']}: {params_text(best['params'])}",
             "why it won:", *[f"  {line}" for line in best["why"]]]
    if notes:
        lines += ["what is set below:", *[f"  {n}" for n in notes]]
    for item in doc.get("broken") or []:
        if not item["points"]:
            lines.append(f"constraint {item['constraint']}: every point met it")
            continue
        lines.append(f"constraint {item['constraint']}: broken by {len(item['points'])} point(s)")
        lines += [f"  {p['id']} ({params_text(p['params'])}): {p['why']}" for p in item["points"]]
    lines += [f"results: {doc['settings']['results']}", "check it: kite config validate THIS_FILE; use it: "
              "copy its keys into $KITE_HOME/config.yaml (kite config path)"]
    return "".join(f"# {line}\n" for line in lines)
