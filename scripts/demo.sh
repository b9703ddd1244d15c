#!/usr/bin/env bash
# `make demo`: the main job on the embedded default model, step by step, with timings.
set -euo pipefail
cd "$(dirname "$0")/.."
KITE=.venv/bin/kite
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "kite version"
$KITE version

step "kite model info (the embedded SmolLM2-135M; the first run converts its GGUF once)"
$KITE model info

step "kite generate --chat"
$KITE generate --chat --prompt "What is the capital of France?" --max-new-tokens 32
