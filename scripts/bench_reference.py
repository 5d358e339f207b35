#!/usr/bin/env python3
"""CPU throughput baseline: transformers/PyTorch float32 on the SmolLM2 GGUF.

How to run (from the repository root, with the venv from scripts/reference.py):
    .venv-ref/bin/python scripts/bench_reference.py                 # threads = os.cpu_count()
    .venv-ref/bin/python scripts/bench_reference.py --threads 2 --json

Measures
  pp512: prefill of 512 fixed pseudo-random token ids (numpy seed 0, ids in
         [100, 49152)), one forward pass with use_cache=False; 1 warm-up,
         then --reps (default 5) timed reps; tokens/s = 512 / seconds.
         Only the last position's logits are computed (logits_to_keep=1),
         as an inference engine's prefill does.
  tg32:  decode with the KV cache: prefill a 16-token prompt (untimed),
         then 32 greedy steps of one token each, every step timed on its own;
         1 warm-up run, then --reps timed runs; tokens/s per run = 32 / sum of
         step times. Reported as mean and standard deviation over the runs.
Prints a markdown table; with --json also prints one JSON object:
  {"pp512_ts", "pp512_std", "tg32_ts", "tg32_std", "threads", "torch", ...}
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GGUF = os.path.join(
    ROOT, "models/cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")


def _cache_kw():
    """transformers >= 5.2x renamed the forward kwarg past_key_values -> cache."""
    import inspect
    from transformers import LlamaForCausalLM
    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _get_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


@torch.inference_mode()
def prefill_once(model, ids):
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t0


@torch.inference_mode()
def decode_once(model, prompt, steps, kw):
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache = _get_cache(out)
    assert cache is not None
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, use_cache=True, **{kw: cache})
        cache = _get_cache(out)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        total += time.perf_counter() - t0
    assert cache.get_seq_length() == prompt.shape[1] + steps, cache.get_seq_length()
    return total


def mean_std(xs):
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModelForCausalLM
    gdir, gname = os.path.split(os.path.abspath(args.gguf))
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    model.eval()

    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(100, 49152, size=(1, args.n_prompt)), dtype=torch.long)
    prompt = ids[:, :16]

    prefill_once(model, ids)  # warm-up
    pp = [args.n_prompt / prefill_once(model, ids) for _ in range(args.reps)]
    kw = _cache_kw()
    decode_once(model, prompt, args.n_gen, kw)  # warm-up
    tg = [args.n_gen / decode_once(model, prompt, args.n_gen, kw) for _ in range(args.reps)]

    pp_m, pp_s = mean_std(pp)
    tg_m, tg_s = mean_std(tg)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"float32, CPU, threads={args.threads}, {gname}")
    print()
    print("| test | t/s |")
    print("| --- | ---: |")
    print(f"| pp{args.n_prompt} | {pp_m:.2f} ± {pp_s:.2f} |")
    print(f"| tg{args.n_gen} | {tg_m:.2f} ± {tg_s:.2f} |")
    if args.json:
        print(json.dumps({
            f"pp{args.n_prompt}_ts": pp_m, f"pp{args.n_prompt}_std": pp_s,
            f"tg{args.n_gen}_ts": tg_m, f"tg{args.n_gen}_std": tg_s,
            "threads": args.threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "reps": args.reps,
            "dtype": "float32", "model": gname,
        }))


if __name__ == "__main__":
    main()
