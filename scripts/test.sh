#!/usr/bin/env bash
# The README's test command: sets up what the tests need on a fresh machine, then runs
# `cargo test --release --workspace` (extra arguments go to cargo test). `.ci/run` calls it too.
set -euo pipefail
cd "$(dirname "$0")/.."

# Mesa's Vulkan loader complains without one; nothing else needs it.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/xdg-runtime-$(id -u)}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
# Cheap kernel autotuning: tests check values, not speed.
export CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}"

# The wgpu tests need a GPU or a Vulkan driver; Mesa's lavapipe runs Vulkan on the CPU. Without
# one they fail at once and say so (they never fall back to a software GL adapter).
if ! ldconfig -p | grep -q libvulkan.so.1 || ! ls /usr/share/vulkan/icd.d/*.json >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing Mesa's lavapipe (Vulkan on the CPU) for the wgpu tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
  else
    echo "warning: no Vulkan driver; install mesa-vulkan-drivers and libvulkan1 (as root) or the wgpu tests fail" >&2
  fi
fi

# HAProxy in front of two `serve` replicas (tests/haproxy.rs); without it that test says it skipped.
if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing HAProxy for tests/haproxy.rs"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null
  else
    echo "warning: no haproxy; tests/haproxy.rs will skip (apt-get install haproxy as root)" >&2
  fi
fi

# The official openai client, which tests/serve.rs drives against the server: a venv of its own
# outside the clone (RIDGEFILL_PYTHON names an interpreter that already has it).
if [ -z "${RIDGEFILL_PYTHON:-}" ]; then
  venv="${RIDGEFILL_OPENAI_VENV:-$HOME/.cache/ridgefill-openai-venv}"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import openai' 2>/dev/null; then
    echo "== a venv with the openai client for tests/serve.rs: $venv"
    if ! python3 -m venv "$venv" 2>/dev/null; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
      fi
      python3 -m venv "$venv"
    fi
    "$venv/bin/pip" install -q openai
  fi
  export RIDGEFILL_PYTHON="$venv/bin/python"
fi

# Every model a test uses, through the project's own fetch (the same release build as the tests).
for model in smollm2-135m gemma3-270m; do
  cargo run --release --quiet -- fetch "$model"
done

cargo test --release --workspace "$@"

# lm-evaluation-harness through `ridgefill serve`, full prefill and skip-and-fill: 3 samples per
# task at 1024 tokens, 2-4 minutes on 2 cores plus the venv's first install (skip it with
# RIDGEFILL_SKIP_LM_EVAL=1).
[ -n "${RIDGEFILL_SKIP_LM_EVAL:-}" ] || scripts/lm_eval.sh --ci
