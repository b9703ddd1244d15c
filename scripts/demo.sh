#!/usr/bin/env bash
# `make demo`: the main job on the embedded default model, step by step, with timings.
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

fact() { .venv/bin/python -c "import json,sys; print(json.loads(open(sys.argv[1]).readline())['facts'][sys.argv[2]])" "$OUT/contract.jsonl" "$1"; }

step "answer from the whole state (no document prefill); the contract says: $(fact jurisdiction)"
$KITE generate --upc "$OUT/contract.upc" --max-new-tokens 12 \
  --prompt $'\nIn short, any action under this Agreement must be brought before the courts in'; took

step "answer loading only the clusters tagged 'payment'; the contract says: $(fact payment)"
$KITE generate --upc "$OUT/contract.upc" --clusters payment --max-new-tokens 12 \
  --prompt $'\nIn short, the fees payable under this Agreement total'; took

printf '\nThe 135M model is small: it answers by continuing the text, and not always right.\n'
printf 'Measure what a setting costs on your own text: kite upcycle eval --input FILE --ratio 8\n'
