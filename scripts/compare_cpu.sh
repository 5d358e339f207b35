#!/usr/bin/env bash
# Side-by-side CPU prefill/decode speed on the same GGUF, same thread count, in one run:
#   ridgefill (flex; weights as stored, then dequantised to f32), transformers (torch, float32) and
#   llama.cpp (llama-cpp-python, weights as stored).
# The three engines take turns for ROUNDS rounds, so load drift on a shared machine hits all alike;
# every round prints each engine's mean ± std over REPS repetitions after its own warm-up.
# Needs the reference venv with llama-cpp-python (scripts/requirements-ref.txt) and the
# SmolLM2 GGUF in models/cache (`ridgefill fetch smollm2-135m`).
# THREADS=N overrides the thread count, REPS=N the timed repetitions, ROUNDS=N the rounds,
# PYTHON the interpreter, RIDGEFILL the binary (default: `cargo run --release`).
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${THREADS:-$(nproc)}"
reps="${REPS:-5}"
rounds="${ROUNDS:-2}"
py="${PYTHON:-.venv-ref/bin/python}"
if [ -n "${RIDGEFILL:-}" ]; then rf=("$RIDGEFILL"); else rf=(cargo run --release -q --); fi
# llama.cpp's column needs llama-cpp-python, a 20-minute source build: leave it out when missing.
llamacpp=1
if ! "$py" -c "import llama_cpp" 2>/dev/null; then
  echo "llama-cpp-python is not installed in $py's environment: skipping the llama.cpp column" >&2
  llamacpp=0
fi
# The transformers column needs torch and transformers (scripts/requirements-ref.txt).
torch=1
if ! "$py" -c "import torch, transformers" 2>/dev/null; then
  echo "torch or transformers is not installed in $py's environment: skipping their column" >&2
  torch=0
fi
for round in $(seq 1 "$rounds"); do
  for weights in native f32; do
    echo "== round $round: ridgefill bench (flex, $threads threads, --weights $weights)"
    RAYON_NUM_THREADS="$threads" RIDGEFILL_THREADS="$threads" "${rf[@]}" bench --device cpu \
      --weights "$weights" -p 512 -n 32 -d 16 -r "$reps" --no-probe
  done
  if [ "$torch" = 1 ]; then
    echo "== round $round: transformers (torch, $threads threads)"
    "$py" scripts/bench_reference.py --threads "$threads" --reps "$reps"
  fi
  if [ "$llamacpp" = 1 ]; then
    echo "== round $round: llama.cpp (llama-cpp-python, $threads threads)"
    "$py" scripts/bench_llamacpp.py --threads "$threads" --reps "$reps"
  fi
done
