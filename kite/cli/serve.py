"""`kite serve`: one model behind an OpenAI-style HTTP API with YOCO, states, admin and metrics.

Thin over `kite.serve`: read the config (flags override it), load the model and its tagger,
build the app, run uvicorn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kite.cli._common import (KvBudgetBlockOpt, KvBudgetCodecOpt, MkdirOpt, check_budget_flags, console,
                              model_spec, rule_errors_reported, user_config)
from kite.errors import KiteError


def serve(
    model: Annotated[str | None, typer.Option("--model", "-m", help="HF folder, .gguf file or embedded name "
                                              "(default: config model.default).")] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default: config server.host, 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: config server.port, 8088).")] = None,
    rules: Annotated[Path | None, typer.Option(help="Rule file (default: config yoco.rules_file).")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Where states live (default: config server.state_dir, "
                                                   "else $KITE_HOME/states).")] = None,
    admin_token: Annotated[str | None, typer.Option(help="Token for /admin (default: config server.admin_token "
                                                    "or KITE_ADMIN_TOKEN; none = admin refused).")] = None,
    fusion: Annotated[bool | None, typer.Option("--fusion/--no-fusion", help="Load states by YOCO's rules "
                                                "(default: config features.upcycle_yoco_fusion).")] = None,
    upcycle_config: Annotated[Path | None, typer.Option(help="upcycle_config.yaml for uploads and the tagger "
                                                        "(default configs/upcycle_config.yaml).")] = None,
    kv_budget_tokens: Annotated[int | None, typer.Option(
        "--kv-budget-tokens", help="Completions without a state hold at most N tokens' KV raw; older tokens are "
        "compressed in blocks and keep taking part in attention (docs/kv-budget.md).")] = None,
    kv_budget_codec: Annotated[str | None, KvBudgetCodecOpt] = None,
    kv_budget_block: Annotated[int | None, KvBudgetBlockOpt] = None,
    max_batch: Annotated[int | None, typer.Option(min=1, help="Sequences decoding together; requests beyond "
                                                  "wait in line (default: config server.max_batch, 8).")] = None,
    batch_kv_gb: Annotated[float | None, typer.Option(help="GB the batch's KV buffers may take (default: config "
                                                      "server.batch_kv_gb, unbounded).")] = None,
    batch_reserve_tokens: Annotated[int | None, typer.Option(
        min=1, help="Allocate every row's KV for N tokens at start (as many rows as --batch-kv-gb holds) and, on a GPU, capture "
        "the decode step of every batch size then, so no request pays a capture or a regrowth (default: config "
        "server.batch_reserve_tokens; unset: the buffers grow on demand).")] = None,
    resident: Annotated[str | None, typer.Option(help="Form loaded states are held in for the batch: raw "
                                                 "(rebuilt KV) or lanes (coded again into nibble lanes read near "
                                                 "their byte floor; default: config server.resident, raw). "
                                                 "docs/serving.md")] = None,
    lane_bits: Annotated[str | None, typer.Option(help="With --resident lanes: bits an element, B or K:V (keys, "
                                                  "values), each 1, 2, 4 or 8 (default: config "
                                                  "server.lane_bits, 4).")] = None,
    replicas: Annotated[int | None, typer.Option(min=1, help="Replicas of this server on Ray Serve behind one "
                                                 "endpoint, with a state-aware router (default: config "
                                                 "server.replicas, 1 = no Ray). docs/scale-out.md")] = None,
    ray_address: Annotated[str | None, typer.Option(help="With --replicas: an existing Ray cluster (default: "
                                                    "config server.ray_address, else a local Ray head; "
                                                    "the endpoint stays on --host).")] = None,
    store: Annotated[str | None, typer.Option("--store", help="A shared, tiered state store (tier URLs, see "
                                              "kite store; default: config store.url): states by content "
                                              "address, fetched on a miss in --state-dir; new states put there.")] = None,
    log_level: Annotated[str, typer.Option(help="Log level (uvicorn's and KITE's): info logs a line per request, "
                                           "rule reloads and switches; warning only refusals and errors.")] = "info",
    mkdir: bool = MkdirOpt,
) -> None:
    """Serve one model over HTTP: /v1/completions, /v1/chat/completions (with a `kite` field naming
    a state or a document), /v1/states, /admin/rules/*, /metrics, /healthz. See docs/serving.md.

    Example: KITE_ADMIN_TOKEN=s3cret kite serve --port 8088 --rules rules/yoco_rules.yaml
    """
    cfg = user_config(overrides={"server.host": host, "server.port": port, "server.admin_token": admin_token,
                                 "server.state_dir": str(state_dir) if state_dir else None,
                                 "features.upcycle_yoco_fusion": fusion, "model.default": model,
                                 "server.max_batch": max_batch, "server.batch_kv_gb": batch_kv_gb,
                                 "server.batch_reserve_tokens": batch_reserve_tokens,
                                 "server.resident": resident, "server.lane_bits": lane_bits,
                                 "server.replicas": replicas, "server.ray_address": ray_address,
                                 "store.url": store})
    model = model_spec(model)
    try:
        from kite.serve import ServeSettings, bind_socket, create_app, run
    except ModuleNotFoundError as exc:
        raise KiteError(f"kite serve needs {exc.name}: pip install 'kite[serve]'") from None
    from kite.serve.settings import LOOPBACK

    check_budget_flags(kv_budget_tokens, kv_budget_codec, kv_budget_block)
    budget_kw = {} if kv_budget_tokens is None else {
        "kv_budget_tokens": kv_budget_tokens, **({"kv_budget_codec": kv_budget_codec} if kv_budget_codec else {}),
        **({"kv_budget_block": kv_budget_block} if kv_budget_block is not None else {})}
    settings = ServeSettings.from_config(cfg, rules=rules, **budget_kw)
    from kite.atomic import check_output_folder

    check_output_folder(settings.state_dir, mkdir, "--state-dir" if state_dir is not None else "server.state_dir")
    from kite.serve.settings import scale_settings

    scale = scale_settings(cfg)   # bad replica bounds fail before anything slow
    if settings.store_url:
        from kite.store import open_store

        open_store(settings.store_url, settings.store_write).close()   # a bad store URL fails before anything slow
    sock = bind_socket(settings.host, settings.port)  # a busy port fails before anything slow
    settings.port = sock.getsockname()[1]  # port 0: the one the system chose
    from kite.model import geometry_from_config, load_config_only
    from kite.yoco.rules import load_rules

    n_layers = geometry_from_config(load_config_only(cfg.model.default)[2]).n_layers  # config only, no weights
    with rule_errors_reported(settings.rules_path):
        # Compiled once, now, against the model's layers: a bad file fails before the weights load,
        # with the errors `kite yoco validate --model` and a reload give.
        ruleset = load_rules(settings.rules_path, n_layers=n_layers)
    out = console()
    from kite.upcycle import compress_settings, load_upcycle_config, open_pipeline

    ucfg = load_upcycle_config(upcycle_config)   # a bad upcycle config fails before the model loads
    from kite.model.sources import resolve
    from kite.serve.app import embedded_states

    embedded = embedded_states(resolve(model))   # so do the states a .gguf embeds (kite gguf embed)
    kept = cfg.features.upcycle_compression_ratio
    compress_settings(ucfg[0], kept_fraction=kept)  # the settings uploads are compressed with
    if scale.distributed:
        sock.close()   # Ray Serve's proxy binds it
        from kite.cli.serve_replicas import serve_replicas

        return serve_replicas(out, model, settings, scale, ucfg, kept, cfg.server.ray_address)
    out.print(f"loading model {model} …", highlight=False)
    pipe = open_pipeline(model, ucfg, kept_fraction=kept)
    settings.budget_settings(pipe.lm.geometry.context_length)  # a budget past the model's context fails now
    app = create_app(pipe, settings, rules=ruleset, embedded=embedded)
    if settings.host not in LOOPBACK:
        out.print(f"[yellow]warning:[/] binding {settings.host}: the API is reachable from other machines",
                  highlight=False)
    admin = "on" if settings.admin_token else "off (no admin token configured)"
    keys = settings.api_keys
    api = ("open (no API keys)" if keys is None else
           f"{len(keys)} API key(s), {len({t for t in keys.values() if t is not None})} tenant(s)")
    store = app.state.kite.store
    embedded = f" + {len(store.embedded)} embedded in {store.embedded_in}" if store.embedded else ""
    out.print(f"[bold green]serving[/] {pipe.lm.source.spec} on http://{settings.host}:{settings.port}  "
              f"rules {settings.rules_path.name}  fusion {'on' if settings.fusion else 'off'}  admin {admin}  api {api}  "
              f"states {settings.state_dir}{embedded}"
              + (f"  store {', '.join(t.name for t in store.shared.tiers)}" if store.shared is not None else "")
              + (f"  states resident in lanes ({settings.lane_bits} bits)" if settings.resident == "lanes" else "")
              + (f"  kv budget {settings.kv_budget_tokens} tokens "
                                                f"({settings.kv_budget_codec})" if settings.kv_budget_tokens else ""),
              highlight=False, soft_wrap=True)
    run(app, settings.host, settings.port, log_level=log_level, sock=sock)
