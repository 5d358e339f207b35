#!/usr/bin/env python3
"""Prints the markdown table of docs/fidelity.md from scripts/fidelity.sh's JSON outputs.

Usage: python3 scripts/fidelity_table.py [data/fidelity]
"""
import glob
import json
import os
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "data/fidelity"
rows = []
for path in sorted(glob.glob(os.path.join(out, "eval-s*-t*.json"))):
    with open(path) as f:
        text = f.read().strip()
    if text:  # an evaluation still running has an empty file
        rows.append(json.loads(text))
rows.sort(key=lambda r: (r["split"], r["tail"]))
print("| split | tail | method | NLL | KL(full‖method) | top-1 | prefill FLOPs vs full |")
print("|---:|---:|---|---:|---:|---:|---:|")
for r in rows:
    for name in ["full", "fill", "drop", "own-proj"]:
        m = r["methods"][name]
        print(f"| {r['split']} | {r['tail']} | {name} | {m['nll']:.4f} | {m['kl']:.4f} | {m['top1']:.3f} | {m['flops_ratio']:.3f} |")
if rows:
    print(f"\n{rows[0]['windows']} windows × {rows[0]['cont']} continuation tokens "
          f"= {rows[0]['tokens']} scored tokens per row; prefix {rows[0]['prefix']}, sink {rows[0]['sink']}.")
