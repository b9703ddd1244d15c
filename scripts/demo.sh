#!/usr/bin/env bash
# `make demo`: the main job on the embedded default model, step by step, with timings. It exits
# non-zero when a step fails, and `kite demo` fails when an answer from the state disagrees with the
# contract (the contract's seed and size are kite.bench.demo's DEMO_SEED and DEMO_TOKENS).
set -euo pipefail
cd "$(dirname "$0")/.."
KITE=.venv/bin/kite
OUT=out/demo
mkdir -p "$OUT"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; START=$EPOCHREALTIME; }
took() { awk -v a="$START" -v b="$EPOCHREALTIME" 'BEGIN { printf "\033[2m   (%.1f s)\033[0m\n", b - a }'; }

step "kite version"
$KITE version; took

step "kite model info (the embedded SmolLM2-135M; the first run converts its GGUF once)"
$KITE model info; took

step "kite generate --chat (plain generation)"
$KITE generate --chat --prompt "What is the capital of France?" --max-new-tokens 32; took

step "kite data contracts: a synthetic contract of ~2,000 tokens"
$KITE data contracts --n 1 --tokens 2000 --seed 7 --out "$OUT/contract.jsonl"
.venv/bin/python -c "import json,sys; r=json.loads(open(sys.argv[1]).readline()); open(sys.argv[2],'w').write(r['text'])" \
  "$OUT/contract.jsonl" "$OUT/contract.txt"
head -c 400 "$OUT/contract.txt"; echo " …"; took

step "kite upcycle compress: prefill once, cluster and tag the clauses, compress the KV cache"
$KITE upcycle compress --input "$OUT/contract.txt" --output "$OUT/contract.upc"; took

step "kite upcycle inspect --verify"
$KITE upcycle inspect "$OUT/contract.upc" --verify; took

step "kite demo: the questions asked from the state (no document prefill), each answer beside the contract's fact"
$KITE demo --contract "$OUT/contract.jsonl" --state "$OUT/contract.upc"; took

printf '\nMeasure what a setting costs on your own text: kite upcycle eval --input FILE --ratio 8\n'
