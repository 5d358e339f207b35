#!/usr/bin/env bash
# docs/fidelity.md "Results at split 15, tail 16": the shipped fill (spans-adapt) against ridge,
# spans, drop and own-proj in domain (Brown r), out of domain (legal: the Debian licence texts;
# code: Python's standard library), retrieval (passkey in both orders, prose, multi-needle),
# prefill speed, and the split search at 10/15/20 (skipped with SKIP_SPLIT_SEARCH=1). Writes
# everything under $OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${RIDGEFILL_BIN:-target/release/ridgefill}"
out="${OUT_DIR:-data/fid}"
mkdir -p "$out/out" "$out/ood/legal" "$out/ood/code"
"$bin" fetch brown >/dev/null
cp /usr/share/common-licenses/{Apache-2.0,GPL-3,LGPL-2.1,MPL-2.0,GFDL-1.3,Artistic,CC0-1.0} "$out/ood/legal/"
py=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
cp "$py"/{argparse,configparser,tarfile,subprocess}.py "$out/ood/code/"
fill="$out/s15.fill"
[ -f "$fill" ] || "$bin" fit --device cpu --split 15 --max-tokens 50000 --alpha 1e-5 \
  --stats-out "$out/s15.stats" -o "$fill"
"$bin" eval --device cpu --fill "$fill" --task prose,multi --lengths 1024,2048,4096 \
  --methods full,fill > "$out/out/prose.md"
for text in brown legal code; do
  case $text in brown) src=(models/cache/brown/cr0*) ;; *) src=("$out/ood/$text") ;; esac
  "$bin" eval --device cpu --fill "$fill" --text "${src[@]}" --max-windows 24 \
    --methods "${TEXT_METHODS:-full,fill,ridge,spans,drop,own-proj}" --json > "$out/out/$text.json"
done
"$bin" eval --device cpu --fill "$fill" --task passkey,passkey-first --lengths 512,1024,2048,4096 \
  --methods "${PASSKEY_METHODS:-full,fill,ridge,spans}" > "$out/out/passkey.md"
"$bin" eval --device cpu --fill "$fill" --task passkey --lengths 8184 --methods full,fill \
  > "$out/out/passkey8k.md"
# Diagnosis: plain ridge with parts of the filled K/V restored from full prefill.
"$bin" eval --device cpu --fill "$fill" --task passkey,prose --lengths 1024 --oracle \
  > "$out/out/oracle.md"
"$bin" bench --device cpu --fill "$fill" -p 512,2048 -n 0 -r 5 --no-probe > "$out/out/bench.md"
[ -n "${SKIP_SPLIT_SEARCH:-}" ] && exit 0
"$bin" fit --device cpu --split auto --max-kl 0.06 --candidates 10,15,20 --max-tokens 50000 \
  --alpha 1e-5 -o "$out/auto.fill" 2>&1 | tee "$out/out/auto.log"
