#!/usr/bin/env bash
# The model-release gate (docs/ci-cd.md): build the native runtime, move the states to the new
# model's fingerprints, then gate the new model on `kite bench run` (thresholds), `kite shadow`
# (golden vs candidate pipeline) and `kite tune auto` (the best config under constraints).
# It stops at the first step that fails. Exit: 0 every step passed; 1 a gate failed (or a step
# broke); 2 bad usage or input (this script's flags, or a step's); 130 interrupted.
# OUT/release_gate.json says which step failed and why; OUT/logs/ holds every step's log.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${KITE_GATE_PYTHON:-python3}
REPORT=("$PYTHON" "$ROOT/scripts/release_gate_report.py")
STEPS=(build-runtime model-info migrate bench shadow tune)

usage() {
  cat <<EOF
Usage: scripts/release_gate.sh --new-model NEW (--old-model OLD | --old-fingerprint FP) --states DIR
                               [--cases FILE] [--out DIR] [options]

Steps, in order (each stops the gate when it fails):
  build-runtime  make build-runtime (the native kernels)
  model-info     kite model info --json of the new (and old) model: their fingerprints
  migrate        kite upcycle migrate: DIR's states from the old model's fingerprint to the new one's
  bench          kite bench run on the new model: exit 1 when a threshold fails
  shadow         kite shadow: the candidate pipeline against the golden one on the new model
  tune           kite tune auto on the new model: OUT/tune/best_config.yaml; exit 1 when no point
                 meets the constraints

Inputs (flag, or environment variable):
  --new-model M        KITE_GATE_NEW_MODEL        the model to release: HF folder, .gguf, embedded name
  --old-model M        KITE_GATE_OLD_MODEL        the model the states were made with, or:
  --old-fingerprint FP KITE_GATE_OLD_FINGERPRINT  its fingerprint (kite upcycle inspect shows it)
  --states DIR         KITE_GATE_STATES           the states (.upc) folder; made if missing
  --cases FILE         KITE_GATE_CASES            cases JSONL (default configs/bench_cases.jsonl)
  --out DIR            KITE_GATE_OUT              results (default out/release-gate)
  --thresholds FILE    KITE_GATE_THRESHOLDS       bench thresholds (default configs/bench.yaml)
  --golden FILE        KITE_GATE_GOLDEN           shadow: the deployed pipeline (default configs/shadow_golden.yaml)
  --candidate FILE     KITE_GATE_CANDIDATE        shadow: the release's pipeline (default configs/shadow_candidate.yaml)
  --max-substantive X  KITE_GATE_MAX_SUBSTANTIVE  shadow: largest substantive-diff rate over noise (default 0.05)
  --kite PATH          KITE_GATE_KITE             the kite command (default .venv/bin/kite, else kite on PATH)

Options:
  --tune-param NAME=V1,V2   a parameter and its values (repeatable; default ratio=4,8)
  --tune-objective NAME     (repeatable; default f1)
  --tune-constraint EXPR    (repeatable; default "ppl_delta < 0.5")
  --baselines LIST          bench baselines beside full prefill (default full: the gate reads only the
                            fused pipeline's figures)
  --families LIST, --per-family N, --max-cases N, --max-new-tokens N
                            which cases and answer length (bench and tune; shadow takes --max-cases and
                            reads the answer length from its pipeline files)
  --threads N               torch CPU threads of every kite step
  --skip STEP[,STEP]        leave steps out (build-runtime, migrate, bench, shadow, tune); reported as skipped
  --json                    print the summary JSON on stdout (the table goes to stderr)

Exit codes: 0 passed; 1 a gate failed; 2 bad usage or input; 130 interrupted.
EOF
}

die_usage() {
  echo "release_gate.sh: $*" >&2
  echo "release_gate.sh: see scripts/release_gate.sh --help" >&2
  exit 2
}

NEW_MODEL=${KITE_GATE_NEW_MODEL:-}
OLD_MODEL=${KITE_GATE_OLD_MODEL:-}
OLD_FP=${KITE_GATE_OLD_FINGERPRINT:-}
STATES=${KITE_GATE_STATES:-}
CASES=${KITE_GATE_CASES:-$ROOT/configs/bench_cases.jsonl}
OUT=${KITE_GATE_OUT:-out/release-gate}
THRESHOLDS=${KITE_GATE_THRESHOLDS:-$ROOT/configs/bench.yaml}
GOLDEN=${KITE_GATE_GOLDEN:-$ROOT/configs/shadow_golden.yaml}
CANDIDATE=${KITE_GATE_CANDIDATE:-$ROOT/configs/shadow_candidate.yaml}
MAX_SUBSTANTIVE=${KITE_GATE_MAX_SUBSTANTIVE:-0.05}
KITE=${KITE_GATE_KITE:-}
BASELINES=full
TUNE_PARAMS=() TUNE_OBJECTIVES=() TUNE_CONSTRAINTS=()
SELECT=() SHADOW_SELECT=() THREADS=() SKIP="" JSON=0

while (($#)); do
  arg=$1
  shift
  if [[ $arg == --*=* ]]; then set -- "${arg#*=}" "$@"; arg=${arg%%=*}; fi
  case $arg in
    -h|--help) usage; exit 0 ;;
    --json) JSON=1; continue ;;
    --new-model|--old-model|--old-fingerprint|--states|--cases|--out|--thresholds|--golden|--candidate|\
    --max-substantive|--kite|--tune-param|--tune-objective|--tune-constraint|--baselines|--families|\
    --per-family|--max-cases|--max-new-tokens|--threads|--skip)
      (($#)) && [[ -n $1 && $1 != --* ]] || die_usage "$arg needs a value"
      value=$1
      shift ;;
    *) die_usage "unknown argument '$arg'" ;;
  esac
  case $arg in
    --new-model) NEW_MODEL=$value ;;
    --old-model) OLD_MODEL=$value ;;
    --old-fingerprint) OLD_FP=$value ;;
    --states) STATES=$value ;;
    --cases) CASES=$value ;;
    --out) OUT=$value ;;
    --thresholds) THRESHOLDS=$value ;;
    --golden) GOLDEN=$value ;;
    --candidate) CANDIDATE=$value ;;
    --max-substantive) MAX_SUBSTANTIVE=$value ;;
    --kite) KITE=$value ;;
    --tune-param) TUNE_PARAMS+=("$value") ;;
    --tune-objective) TUNE_OBJECTIVES+=("$value") ;;
    --tune-constraint) TUNE_CONSTRAINTS+=("$value") ;;
    --baselines) BASELINES=$value ;;
    --families|--per-family|--max-new-tokens) SELECT+=("$arg" "$value") ;;
    --max-cases) SELECT+=("$arg" "$value"); SHADOW_SELECT+=("$arg" "$value") ;;
    --threads) THREADS=(--threads "$value") ;;
    --skip) SKIP+=",$value" ;;
  esac
done

((${#TUNE_PARAMS[@]})) || TUNE_PARAMS=("ratio=4,8")
((${#TUNE_OBJECTIVES[@]})) || TUNE_OBJECTIVES=(f1)
((${#TUNE_CONSTRAINTS[@]})) || TUNE_CONSTRAINTS=("ppl_delta < 0.5")

skipped() { [[ ",$SKIP," == *",$1,"* ]]; }

# Everything below is checked before anything slow runs.
for s in ${SKIP//,/ }; do
  case $s in build-runtime|migrate|bench|shadow|tune) ;; *) die_usage "--skip $s: not a step (build-runtime, migrate, bench, shadow, tune)" ;; esac
done
[[ -n $NEW_MODEL ]] || die_usage "give --new-model (or KITE_GATE_NEW_MODEL): the model to release"
[[ -n $STATES ]] || die_usage "give --states DIR (or KITE_GATE_STATES): the states folder to migrate and gate"
if ! skipped migrate; then
  [[ -n $OLD_MODEL || -n $OLD_FP ]] || die_usage "give --old-model or --old-fingerprint: what the states were made with"
  [[ -z $OLD_MODEL || -z $OLD_FP ]] || die_usage "give --old-model or --old-fingerprint, not both"
fi
[[ -f $CASES ]] || die_usage "--cases $CASES: no such file"
skipped bench || [[ -f $THRESHOLDS ]] || die_usage "--thresholds $THRESHOLDS: no such file"
if ! skipped shadow; then
  [[ -f $GOLDEN ]] || die_usage "--golden $GOLDEN: no such file"
  [[ -f $CANDIDATE ]] || die_usage "--candidate $CANDIDATE: no such file"
fi
for p in "${TUNE_PARAMS[@]}"; do
  [[ $p =~ ^[A-Za-z_][A-Za-z0-9_.#]*=[^=]+$ ]] || die_usage "--tune-param $p: expected NAME=V1,V2 (e.g. ratio=4,8)"
done
if [[ -z $KITE ]]; then
  if [[ -x $ROOT/.venv/bin/kite ]]; then KITE=$ROOT/.venv/bin/kite; else KITE=$(command -v kite || true); fi
fi
[[ -n $KITE && -x $(command -v "$KITE" || true) ]] || die_usage "no kite command (make install, or --kite PATH)"
command -v "$PYTHON" >/dev/null || die_usage "no $PYTHON (KITE_GATE_PYTHON names another)"
[[ ! -e $STATES || -d $STATES ]] || die_usage "--states $STATES: not a folder"
mkdir -p "$OUT/logs" 2>/dev/null || die_usage "--out $OUT: cannot make the folder"
if [[ ! -d $STATES ]]; then
  mkdir -p "$STATES" || die_usage "--states $STATES: cannot make the folder"
  echo "release_gate.sh: --states $STATES did not exist: made it (no states to migrate)" >&2
fi

SUMMARY=$OUT/release_gate.json
LOGS=$OUT/logs
"${REPORT[@]}" init "$SUMMARY" "new_model=$NEW_MODEL" "old_model=$OLD_MODEL" "old_fingerprint=$OLD_FP" \
  "states=$STATES" "cases=$CASES" "out=$OUT" "thresholds=$THRESHOLDS" "golden=$GOLDEN" \
  "candidate=$CANDIDATE" "max_substantive=$MAX_SUBSTANTIVE" "kite=$KITE" "skip=${SKIP#,}"

INTERRUPTED=0
trap 'INTERRUPTED=1' INT TERM

now() { local t=${EPOCHREALTIME/,/.}; echo "$t"; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# run LOG STDOUT CMD...: the command's stdout to STDOUT (- : into the log too), its stderr to
# LOGS/LOG.log and to ours; sets RC. tee ignores Ctrl-C so the command's last words are kept.
run() {
  local log=$LOGS/$1.log stdout=$2
  shift 2
  if ((INTERRUPTED)); then RC=130; : >"$log"; return 0; fi  # Ctrl-C between steps: start nothing
  printf '\n== %s\n' "$(printf '%q ' "$@")" >&2
  set +e
  if [[ $stdout == - ]]; then
    "$@" 2>&1 | (trap '' INT; exec tee "$log") >&2
  else
    "$@" 2>&1 >"$stdout" | (trap '' INT; exec tee "$log") >&2
  fi
  RC=${PIPESTATUS[0]}
  set -e
  ((INTERRUPTED)) && RC=130
  return 0
}

# record NAME STATUS RC SECONDS REASON [KEY=VALUE...]: into the summary, one line on stderr.
record() {
  "${REPORT[@]}" step "$SUMMARY" "$@"
  printf '%s: %s (%s s) %s\n' "$1" "$2" "${4:-0}" "$5" >&2
}

# stop NAME RC REASON: the gate ends here; exit 1 for a failed gate, 2 for bad input, 130 Ctrl-C.
stop() {
  local name=$1 rc=$2 reason=$3 code
  case $rc in 2) code=2 ;; 130) code=130 ;; *) code=1 ;; esac
  finish "$code"
  if ((code == 130)); then
    echo "release gate: interrupted at $name: $reason" >&2
  else
    echo "release gate: $name failed (exit $rc): $reason" >&2
  fi
  exit "$code"
}

finish() {
  "${REPORT[@]}" finish "$SUMMARY" "$1"
  if ((JSON)); then
    "${REPORT[@]}" table "$SUMMARY" >&2
    cat "$SUMMARY"
  else
    printf '\n' >&2
    "${REPORT[@]}" table "$SUMMARY"
    echo "summary: $SUMMARY"
  fi
}

status_of() { case $1 in 0) echo passed ;; 130) echo interrupted ;; *) echo failed ;; esac; }

# step NAME STDOUT CMD...: run, find the reason, record, stop on failure.
step() {
  local name=$1 stdout=$2 t0 secs reason status
  shift 2
  t0=$(now)
  run "$name" "$stdout" "$@"
  secs=$(since "$t0")
  if [[ $name == build-runtime ]]; then
    if ((RC)); then
      reason="make build-runtime failed: $(grep -v '^make' "$LOGS/$name.log" | tail -n 1 || true)"
    else
      reason="up to date: $(cd "$ROOT" && echo build/libkite_runtime*.so)"
    fi
  else
    reason=$("${REPORT[@]}" reason "$name" "$RC" "$stdout" "$LOGS/$name.log")
  fi
  [[ -s $LOGS/$name.log || $RC -ne 130 ]] || reason="interrupted (Ctrl-C) before it started"
  status=$(status_of "$RC")
  record "$name" "$status" "$RC" "$secs" "$reason" "log=$LOGS/$name.log" \
    "output=$([[ $stdout == - ]] || echo "$stdout")" "command=$(printf '%q ' "$@")" ${EXTRA[@]+"${EXTRA[@]}"}
  EXTRA=()
  ((RC == 0)) || stop "$name" "$RC" "$reason"
}
EXTRA=()

# 1. the native runtime
if skipped build-runtime; then
  record build-runtime skipped "" "" "--skip"
else
  step build-runtime - make --no-print-directory -C "$ROOT" build-runtime
fi

# 2. fingerprints: the new model's always (what was gated), the old model's when migrating
# model_info new|old MODEL: its `kite model info --json` into OUT/model-WHICH.json, or the gate stops.
model_info() {
  local which=$1 model=$2 reason
  run "model-info-$which" "$OUT/model-$which.json" "$KITE" model info --model "$model" --json
  ((RC)) || return 0
  reason="$which model: $("${REPORT[@]}" reason model-info "$RC" "$OUT/model-$which.json" "$LOGS/model-info-$which.log")"
  record model-info "$(status_of "$RC")" "$RC" "$(since "$t0")" "$reason" "log=$LOGS/model-info-$which.log"
  stop model-info "$RC" "$reason"
}
t0=$(now)
model_info new "$NEW_MODEL"
NEW_FP=$("${REPORT[@]}" fingerprint "$OUT/model-new.json")
if ! skipped migrate && [[ -n $OLD_MODEL ]]; then
  if [[ $OLD_MODEL == "$NEW_MODEL" ]]; then
    cp "$OUT/model-new.json" "$OUT/model-old.json"
  else
    model_info old "$OLD_MODEL"
  fi
  OLD_FP=$("${REPORT[@]}" fingerprint "$OUT/model-old.json")
fi
short() { local h=${1#kite-fp1:}; echo "${h:0:12}"; }
reason="new $(short "$NEW_FP") ($NEW_MODEL)"
if [[ -n $OLD_FP ]]; then
  reason+="; old $(short "$OLD_FP")${OLD_MODEL:+ ($OLD_MODEL)}"
  if [[ ${NEW_FP#kite-fp1:} == "${OLD_FP#kite-fp1:}"* ]]; then reason+=": the same fingerprint"; fi
fi
record model-info passed 0 "$(since "$t0")" "$reason" "log=$LOGS/model-info-new.log" \
  "new_fingerprint=$NEW_FP" "old_fingerprint=$OLD_FP"

# 3. the states, moved to the new model's fingerprints (journaled: a re-run resumes)
if skipped migrate; then
  record migrate skipped "" "" "--skip"
elif ! compgen -G "$STATES/*.upc" >/dev/null; then
  record migrate skipped "" 0 "no .upc states in $STATES: nothing to move (the bench gate makes them for the new model)"
else
  step migrate "$OUT/migrate.json" "$KITE" upcycle migrate --old-model-fingerprint "$OLD_FP" \
    --new-model-fingerprint "$NEW_FP" --upcycle-dir "$STATES" --new-model "$NEW_MODEL" --json
fi

# 4. bench gate: the fused pipeline on the new model against its full prefill, with thresholds
if skipped bench; then
  record bench skipped "" "" "--skip"
else
  EXTRA=("results=$OUT/bench/results.json")
  step bench "$OUT/bench.json" "$KITE" bench run --model "$NEW_MODEL" --cases "$CASES" \
    --upcycle "$STATES" --thresholds "$THRESHOLDS" --baselines "$BASELINES" \
    --output "$OUT/bench/results.json" --mkdir --json ${SELECT[@]+"${SELECT[@]}"} ${THREADS[@]+"${THREADS[@]}"}
fi

# 5. shadow gate: the release's pipeline against the deployed one, on the new model
if skipped shadow; then
  record shadow skipped "" "" "--skip"
else
  step shadow "$OUT/shadow.json" "$KITE" shadow --golden "$GOLDEN" --candidate "$CANDIDATE" \
    --cases "$CASES" --model "$NEW_MODEL" --upcycle "$STATES" --max-substantive "$MAX_SUBSTANTIVE" \
    --json ${SHADOW_SELECT[@]+"${SHADOW_SELECT[@]}"} ${THREADS[@]+"${THREADS[@]}"}
fi

# 6. tune on the new model: the best config under the constraints
if skipped tune; then
  record tune skipped "" "" "--skip"
else
  TUNE=()
  for p in "${TUNE_PARAMS[@]}"; do TUNE+=(--param "${p%%=*}" --values "${p#*=}"); done
  for o in "${TUNE_OBJECTIVES[@]}"; do TUNE+=(--objective "$o"); done
  for c in "${TUNE_CONSTRAINTS[@]}"; do TUNE+=(--constraint "$c"); done
  EXTRA=("config=$OUT/tune/best_config.yaml")
  step tune "$OUT/tune.json" "$KITE" tune auto --model "$NEW_MODEL" --cases "$CASES" --upcycle "$STATES" \
    "${TUNE[@]}" --output "$OUT/tune/best_config.yaml" --mkdir --json \
    ${SELECT[@]+"${SELECT[@]}"} ${THREADS[@]+"${THREADS[@]}"}
fi

finish 0
