#!/usr/bin/env bash
# One-call GPU check for a lent device machine (no network there): logit parity of flex against
# every GPU backend the binary has, on random-weight models of SmolLM2-135M's and a 1B Llama's
# shape, then `bench` (full vs fill, and decode with packed vs dense weights) on each backend
# and `probe` ceilings. Results land in $OUT.
#
# Build here, carry the binary, run there:
#   cargo build --release && mkdir -p dist && cp "$CARGO_TARGET_DIR/release/ridgefill" dist/
#   run(command="bash scripts/gpu-check.sh", carry=["dist"])
# A CUDA binary (`--features cuda`) needs cubecl's LLVM download at build time; without one the
# GPU is reached through wgpu's Vulkan backend, and the cuda rows say why they are missing.
set -uo pipefail
cd "$(dirname "$0")/.."
bin="${RIDGEFILL_BIN:-dist/ridgefill}"
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
log="$out/gpu-check.md"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/xdg-runtime-$(id -u)}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"

step() { echo; echo "## $*"; echo; }
{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  step "machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  echo "cpu: $(nproc) cores"; "$bin" --version
  step "probe"
  timeout 120 "$bin" probe --device cpu,wgpu 2>&1
  for backend in wgpu cuda; do
    for shape in smollm2-135m llama-1b; do
      step "parity: flex vs $backend, synthetic:$shape"
      timeout 300 "$bin" parity -m "synthetic:$shape" --device "cpu,$backend" -p 128 -n 4 2>&1
      echo "exit: $?"
    done
  done
  for backend in wgpu cuda; do
    step "bench: $backend, synthetic:smollm2-135m (fill s=15 with own-projection maps)"
    timeout 300 "$bin" bench -m synthetic:smollm2-135m --device "$backend" --split 15 \
      -p 512,2048 -n 32 -r 5 -o md --out "$out/bench-$backend-smollm2.md" 2>&1 \
      && cat "$out/bench-$backend-smollm2.md"
    step "bench: $backend, synthetic:llama-1b (fill s=8)"
    timeout 300 "$bin" bench -m synthetic:llama-1b --device "$backend" --split 8 \
      -p 512,2048 -n 32 -r 5 -o md --out "$out/bench-$backend-llama1b.md" 2>&1 \
      && cat "$out/bench-$backend-llama1b.md"
    # Decode reads every weight each step: its GB/s against probe's is the packed kernel's grade.
    step "bench: $backend, synthetic:llama-1b decode, packed Q4_0 (native) vs dense f32"
    for w in native f32; do
      timeout 200 "$bin" bench -m synthetic:llama-1b --device "$backend" --weights "$w" \
        -p 128 -n 64 -d 512 -b 1,8,16 -r 3 -o md 2>&1
    done
  done
  step "bench: flex (same machine's CPU), synthetic:smollm2-135m"
  timeout 300 "$bin" bench -m synthetic:smollm2-135m --device cpu --split 15 -p 512 -n 32 -r 3 \
    --no-probe -o md 2>&1
} 2>&1 | tee "$log"
