#!/usr/bin/env bash
# The whole workspace checked (clippy) for aarch64 Linux, and the quantised kernels' tests (NEON,
# and NEON with the dot-product extension) built for it and run under qemu-user on an x86-64
# machine: every format against the scalar kernels and the f64 reference, on random blocks and
# SmolLM2's / Gemma 3's tensors when fetched.
# Correctness only: emulated timings say nothing about ARM hardware.
#
# Installs what it needs when missing (qemu-user and the aarch64 cross gcc through apt, as root;
# the rust-std component through rustup). If those cannot be installed it says so and exits 0;
# a failing test exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
export CARGO_TARGET_DIR="${RIDGEFILL_AARCH64_TARGET_DIR:-$HOME/.cache/ridgefill-target-aarch64}"

skip() {
  echo "check-aarch64: skipped: $*" >&2
  exit 0
}

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
  [ "$(id -u)" = 0 ] || skip "qemu-aarch64 or aarch64-linux-gnu-gcc missing (install qemu-user gcc-aarch64-linux-gnu)"
  { apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu \
      libc6-dev-arm64-cross >/dev/null; } || skip "apt-get could not install qemu-user and the cross gcc"
fi
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  rustup target add "$target" || skip "rustup could not add $target"
fi

export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
# `-cpu max` has the dot-product extension, so both NEON levels run.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu max"

# The whole workspace must build for aarch64 (Apple Silicon, ARM servers): a check, no codegen.
cargo clippy --release --workspace --all-targets --target "$target" -- -D warnings
cargo test --release -p ridgefill-quant --target "$target"
