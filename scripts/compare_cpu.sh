#!/usr/bin/env bash
# Side-by-side CPU prefill/decode speed: ridgefill (flex) and transformers (torch) on the same GGUF,
# same thread count, in one run. Needs the reference venv (see scripts/reference.py).
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${THREADS:-$(nproc)}"
py="${PYTHON:-.venv-ref/bin/python}"
echo "== ridgefill bench (flex, $threads threads)"
RAYON_NUM_THREADS="$threads" cargo run --release -q -- bench --device cpu -p 512 -n 32 -r 5
echo "== transformers (torch, $threads threads)"
"$py" scripts/bench_reference.py --threads "$threads" --reps 5
