#!/usr/bin/env bash
# Fidelity table for docs/fidelity.md: fit SmolLM2-135M on the first 50k tokens of Brown (the
# following documents held out to choose alpha), then evaluate on Brown category r (humour), which
# the fit never sees, for splits 10/15/20 and tails 16/64.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${RIDGEFILL_BIN:-target/release/ridgefill}"
out="${OUT_DIR:-data/fidelity}"
windows="${WINDOWS:-24}"
mkdir -p "$out"
"$bin" fetch brown >/dev/null
for split in 10 15 20; do
  fill="$out/smollm2-s$split.fill"
  [ -f "$fill" ] || (time "$bin" fit --device cpu --split "$split" --max-tokens 50000 -o "$fill") 2>&1 | tee "$out/fit-s$split.log"
  for tail in 16 64; do
    "$bin" eval --device cpu --fill "$fill" --text models/cache/brown/cr0* --tail "$tail" \
      --max-windows "$windows" --json > "$out/eval-s$split-t$tail.json"
    echo "split $split tail $tail: $(cat "$out/eval-s$split-t$tail.json")"
  done
done
python3 scripts/fidelity_table.py "$out"
