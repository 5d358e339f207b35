#!/usr/bin/env bash
# lm-evaluation-harness against `ridgefill serve`, full prefill beside skip-and-fill: RULER's
# synthetic long-context tasks (generated locally from the model's own tokenizer, no data set
# download) and a small local multiple-choice task that goes through /v1/completions' `echo` +
# `logprobs` (scripts/lm_eval_tasks/). Prints task x full x fill and keeps lm-eval's JSON results.
#
#   scripts/lm_eval.sh [--limit N] [--lengths 2048[,4096...]] [--model M] [--fill FILE]
#                      [--tasks LIST] [--results DIR] [--parallel N] [--tokenizer-from M2]
#                      [--no-cache-prompt] [--ci] [-- LM_EVAL_ARGS...]
#
# --no-cache-prompt: both servers prefill every prompt whole (lm-eval's prompts of a task share
# their opening, so with reuse a request prefills only its tail). With --parallel 1 the table's
# summed prefill seconds are then the two methods' cold prefill times over the suite's prompts.
#
# --tokenizer-from: the model whose exported tokenizer lm-eval sizes RULER's prompts with
# (default: --model). For a model whose tokenizer is not exported (SentencePiece: Gemma 3),
# e.g. `--model gemma3-270m --tokenizer-from smollm2-135m`: the prompts are then as long as
# that tokenizer counts, and go to the server as text, which it tokenizes with the model's own.
#
# Defaults: 15 samples per task at 2048 tokens, smollm2-135m, data/fid/s15q.fill, results in
# data/lm_eval/DATE. Left out: RULER's NIAH tasks on essay haystacks (niah_single_2/3,
# niah_multikey_1, niah_multivalue, niah_multiquery) and its QA tasks, which download data sets.
# --ci: 3 samples per task at 1024 tokens; fails if any task errors or reports no score. Unless
# --fill is given it fits a quick fill of its own (split 15, 8k tokens: the run checks the path
# works, not the fill's quality; data/ is not in the repository). Python packages come from
# PyPI into a venv outside the clone ($RIDGEFILL_LMEVAL_VENV, default
# ~/.cache/ridgefill-lmeval-venv); no torch: the model runs in the server, lm-eval only tokenizes.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

limit=15
lengths=2048
model=smollm2-135m
tokenizer_from=""
serve_extra=()
fill=data/fid/s15q.fill
fill_given=0
tasks=niah_single_1,niah_multikey_2,niah_multikey_3,ruler_vt,ruler_cwe,ruler_fwe,ridgefill_cloze
results=""
parallel=4
ci=0
extra=()
# An option that takes a value, given last without one, would trip `set -u` with bash's own message.
need() { [ "$2" -ge 2 ] || { echo "error: $1 needs a value" >&2; exit 2; }; }
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --limit|--lengths|--model|--fill|--tasks|--results|--parallel|--tokenizer-from) need "$1" $# ;;&
    --limit) limit=$2; shift 2 ;;
    --lengths) lengths=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --fill) fill=$2; fill_given=1; shift 2 ;;
    --tasks) tasks=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    --parallel) parallel=$2; shift 2 ;;
    --tokenizer-from) tokenizer_from=$2; shift 2 ;;
    --no-cache-prompt) serve_extra+=(--no-cache-prompt); shift ;;
    --ci) ci=1; limit=3; lengths=1024; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage 0 ;;
    *) echo "error: unknown argument $1" >&2; usage 2 >&2 ;;
  esac
done
[[ "$parallel" =~ ^[0-9]+$ && "$parallel" -gt 0 ]] || { echo "error: --parallel $parallel: expected a positive integer" >&2; exit 2; }
[[ "$limit" =~ ^[0-9]+$ && "$limit" -gt 0 ]] || { echo "error: --limit $limit: expected a positive integer" >&2; exit 2; }
[[ "$lengths" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "error: --lengths $lengths: expected comma-separated token counts, e.g. 2048,4096" >&2; exit 2; }
results=${results:-data/lm_eval/$(date +%Y%m%d-%H%M%S)$(if [ $ci = 1 ]; then echo -ci; fi)}
mkdir -p "$results"
results=$(cd "$results" && pwd)

# --- Python: lm-eval with the API model and RULER's extras (nltk, wonderwords, scipy) ---------
venv="${RIDGEFILL_LMEVAL_VENV:-$HOME/.cache/ridgefill-lmeval-venv}"
pins=("lm-eval[api,ruler]==0.4.13" "transformers==5.25.0")
if [ ! -x "$venv/bin/lm_eval" ] || ! "$venv/bin/python" -c 'import lm_eval, transformers, wonderwords, nltk, scipy' 2>/dev/null; then
  echo "== a venv with lm-evaluation-harness: $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "${pins[@]}"
fi
# RULER's module downloads NLTK's punkt_tab at import when it is missing; only the essay
# haystacks (niah_single_2/3, multikey_1, multivalue, multiquery: all need a Hugging Face data
# set, so they are left out) split sentences. An empty stand-in stops the download attempt.
export NLTK_DATA="$venv/nltk_data"
mkdir -p "$NLTK_DATA/tokenizers/punkt_tab"
# Nothing may come from the hub: RULER's samples are made here, the tokenizer is a local folder.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# --- RidgeFill: binary, tokenizer for lm-eval, fill file ----------------------------------------
cargo build --release --quiet
bin="${CARGO_TARGET_DIR:-target}/release/ridgefill"
tok="$results/tokenizer"
"$bin" info -m "${tokenizer_from:-$model}" --export-tokenizer "$tok" >/dev/null
if [ $ci = 1 ] && [ $fill_given = 0 ]; then
  fill="$results/s15-ci.fill"
  echo "== a quick fit at split 15 for the CI run: $fill"
  "$bin" fit -m "$model" --device cpu --split 15 --max-tokens 8000 --alpha 1e-5 -o "$fill" 2>&1 | tail -1
elif [ ! -f "$fill" ]; then
  echo "error: fill file $fill not found: make one with \`ridgefill fit --split 15 --max-tokens 50000 -o FILE\` and pass --fill FILE" >&2
  exit 1
fi

# Another model's token ids mean nothing to this one: send text.
text_requests=""
[ -n "$tokenizer_from" ] && [ "$tokenizer_from" != "$model" ] && text_requests=",tokenized_requests=False"
max_len=$(tr ',' '\n' <<<"$lengths" | sort -n | tail -1)
# RULER's lengths include its answer (at most 128 tokens); room for lm-eval's rounding on top.
ctx=$((max_len + 256))
server_pid=""
stop_server() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  fi
}
trap stop_server EXIT

# Starts `ridgefill serve` with the given extra flags; sets $port once it listens.
start_server() {
  local log="$1"; shift
  : >"$log"
  "$bin" serve -m "$model" --device cpu --port 0 --ctx "$ctx" --parallel "$parallel" "$@" 2>"$log" &
  server_pid=$!
  port=""
  for _ in $(seq 600); do
    port=$(sed -n 's/.*listening on http:\/\/127\.0\.0\.1:\([0-9]*\).*/\1/p' "$log" | head -1 || true)
    [ -n "$port" ] && return 0
    kill -0 "$server_pid" 2>/dev/null || { echo "error: ridgefill serve exited:" >&2; cat "$log" >&2; exit 1; }
    sleep 0.2
  done
  echo "error: ridgefill serve did not start listening within 120 s (log: $log)" >&2
  exit 1
}

declare -A wall
for mode in full fill; do
  flags=()
  [ "$mode" = fill ] && flags=(--fill "$fill")
  start_server "$results/serve-$mode.log" "${flags[@]}" "${serve_extra[@]}"
  t0=$(date +%s)
  # One lm-eval run a length: with several lengths in one run, --limit takes its samples from
  # the first length's documents only and the others report no score.
  for len in ${lengths//,/ }; do
    echo "== $mode: ridgefill serve on port $port; lm_eval --tasks $tasks --limit $limit at $len tokens"
    log="$results/lm_eval-$mode-$len.log"
    "$venv/bin/lm_eval" --model local-completions \
      --model_args "model=$model,base_url=http://127.0.0.1:$port/v1/completions,tokenizer=$tok,tokenizer_backend=huggingface,max_length=$ctx,num_concurrent=$parallel,max_retries=1,timeout=3600$text_requests" \
      --include_path "$repo/scripts/lm_eval_tasks" --tasks "$tasks" \
      --metadata "{\"max_seq_lengths\":[$len]}" --limit "$limit" \
      --output_path "$results/$mode/$len" --log_samples --seed 1234 "${extra[@]}" \
      >"$log" 2>&1 || {
        echo "error: lm_eval ($mode, $len tokens) failed; the end of $log:" >&2
        tail -30 "$log" >&2
        exit 1
      }
  done
  wall[$mode]=$(( $(date +%s) - t0 ))
  curl -s "http://127.0.0.1:$port/metrics" >"$results/metrics-$mode.txt" 2>/dev/null || true
  stop_server
done

# --- The table ----------------------------------------------------------------------------------
"$venv/bin/python" - "$results" "$tasks" "$lengths" "$ci" "${wall[full]}" "${wall[fill]}" "$fill" <<'EOF'
import glob, json, os, sys

results, tasks, lengths, ci, wall_full, wall_fill, fill = sys.argv[1:]
tasks, lengths = tasks.split(","), lengths.split(",")

def load(mode):
    # Each length's run has its own results file; a task's scores are merged over them.
    merged = {}
    for L in lengths:
        files = sorted(glob.glob(os.path.join(results, mode, L, "**", "results_*.json"),
                                 recursive=True), key=os.path.getmtime)
        if not files:
            sys.exit(f"error: no lm-eval results under {results}/{mode}/{L}")
        for task, scores in json.load(open(files[-1]))["results"].items():
            merged.setdefault(task, {}).update(
                {k: v for k, v in scores.items() if not (isinstance(v, (int, float)) and v < 0)})
    return merged

full, filled = load("full"), load("fill")
rows, missing = [], []
for task in tasks:
    # RULER reports one score per length; other tasks their accuracy.
    metrics = [(f"{L}", f"{L},none") for L in lengths] if task not in ("ridgefill_cloze",) \
        else [("acc", "acc,none")]
    for label, key in metrics:
        a, b = full.get(task, {}).get(key), filled.get(task, {}).get(key)
        for mode, v in (("full", a), ("fill", b)):
            if not isinstance(v, (int, float)) or v < 0:
                missing.append(f"{task} {label} ({mode})")
        fmt = lambda v: f"{v:.2f}" if isinstance(v, (int, float)) and v >= 0 else "n/a"
        rows.append((task, label, fmt(a), fmt(b)))

table = ["| task | metric | full | fill |", "|---|---|---:|---:|"]
table += [f"| {t} | {m} | {a} | {b} |" for t, m, a, b in rows]
def metrics(mode):
    m = {}
    for line in open(os.path.join(results, f"metrics-{mode}.txt"), errors="replace"):
        if line.startswith("ridgefill_") and " " in line:
            k, v = line.split(" ", 1)
            m[k] = v.strip()
    return m

def prefills(m):
    # The server's own count: proof that the fill ran (prompt-logprob requests always run full).
    return f"{m.get('ridgefill_filled_requests_total', '?')}/{m.get('ridgefill_requests_total', '?')}"

def seconds(m, key):
    v = m.get(key)
    return f"{float(v):.1f}" if v else "?"

def ratio(key):
    # Full's seconds over the fill's: the fill's speed-up on these requests.
    try:
        return f"{float(mf[key]) / float(mb[key]):.2f}x"
    except (KeyError, ValueError, ZeroDivisionError):
        return ""

mf, mb = metrics("full"), metrics("fill")
table.append(f"| requests prefilled with skip-and-fill | | {prefills(mf)} | {prefills(mb)} |")
# Summed over requests; time to first token includes queueing (lm-eval sends --parallel at once),
# prefill includes other slots' steps between a request's chunks unless --parallel is 1.
for label, key in (("time to first token, summed (s)", "ridgefill_ttft_seconds_sum"),
                   ("prefill, summed (s)", "ridgefill_prefill_seconds_total")):
    table.append(f"| {label} | {ratio(key)} | {seconds(mf, key)} | {seconds(mb, key)} |")
table.append(f"| wall time (s) | | {wall_full} | {wall_fill} |")
text = "\n".join(table)
print(f"\nfill file: {fill}\n{text}")
open(os.path.join(results, "table.md"), "w").write(text + "\n")
print(f"\nresults: {results}")
if missing:
    sys.exit("error: no score for " + ", ".join(missing))
if ci == "1":
    # The plain closing line CI reads: every task scored in both modes.
    print(f"lm-eval: {2 * len(rows)} passed, 0 failed")
EOF
