#!/usr/bin/env bash
# Side-by-side CPU prefill/decode speed on the same GGUF, same thread count, in one run:
#   ridgefill (flex), transformers (torch, float32) and llama.cpp (llama-cpp-python, weights as stored).
# Needs the reference venv with llama-cpp-python (scripts/requirements-ref.txt) and the
# SmolLM2 GGUF in models/cache (`ridgefill fetch smollm2-135m`).
# THREADS=N overrides the thread count, REPS=N the timed repetitions, PYTHON the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${THREADS:-$(nproc)}"
reps="${REPS:-5}"
py="${PYTHON:-.venv-ref/bin/python}"
echo "== ridgefill bench (flex, $threads threads)"
RAYON_NUM_THREADS="$threads" cargo run --release -q -- bench --device cpu -p 512 -n 32 -r "$reps"
echo "== transformers (torch, $threads threads)"
"$py" scripts/bench_reference.py --threads "$threads" --reps "$reps"
echo "== llama.cpp (llama-cpp-python, $threads threads)"
"$py" scripts/bench_llamacpp.py --threads "$threads" --reps "$reps"
