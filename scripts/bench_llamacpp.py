#!/usr/bin/env python3
"""CPU throughput baseline: llama.cpp (via llama-cpp-python) on the SmolLM2 GGUF.

The third column of scripts/compare_cpu.sh, next to ridgefill and transformers
(scripts/bench_reference.py). llama.cpp runs the Q4_1 weights as they are in the
GGUF (quantized matmuls, f16 KV cache, its own CPU kernels built with
-march=native by llama-cpp-python's source build).

How to run (from the repository root, with the reference venv plus the pinned
llama-cpp-python from scripts/requirements-ref.txt):
    .venv-ref/bin/python scripts/bench_llamacpp.py                  # threads = os.cpu_count()
    .venv-ref/bin/python scripts/bench_llamacpp.py --threads 2 --reps 3 --json
    .venv-ref/bin/python scripts/bench_llamacpp.py --n-prompt 512,2048

Measures (llama_cpp.Llama, n_batch = n_ubatch = 512, n_threads = n_threads_batch
= --threads, logits_all=False, n_ctx = max(2048, largest prompt), f16 KV cache,
flash attention off unless --flash-attn):
  ppN:  prefill of N pseudo-random token ids in [100, n_vocab) (numpy
        default_rng(0); new ids every repetition, so nothing can be reused),
        timed around Llama.eval(ids), which decodes them in ceil(N / 512)
        batches and computes the logits of the last position only.
        The KV cache is cleared (and Llama.reset()) before every repetition.
        1 warm-up, then --reps timed reps; tokens/s = N / seconds.
  tg32: decode with the KV cache: clear, eval a 16-token prompt (untimed),
        then 32 greedy steps of one token each (Llama.eval([tok]) + argmax
        of the logits), every step timed on its own; 1 warm-up run, then
        --reps timed runs; tokens/s per run = 32 / sum of step times.
  Each reported as mean and standard deviation over the reps.
Prints a markdown table in the format of bench_reference.py; with --json also
prints one JSON object:
  {"pp512_ts", "pp512_std", "tg32_ts", "tg32_std", "threads", "llama_cpp_python", ...}
(one ppN_ts / ppN_std pair for each --n-prompt value).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GGUF = os.path.join(
    ROOT, "models/cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
N_BATCH = 512
PROMPT_TG = 16


def clear_cache(llm):
    """Empty the KV cache and the Python-side token history of `llm`."""
    llm.reset()
    ctx = llm._ctx
    # llama-cpp-python renamed kv_cache_clear -> memory_clear when llama.cpp
    # replaced llama_kv_self_clear with llama_memory_clear.
    if hasattr(ctx, "memory_clear"):
        ctx.memory_clear(True)
    elif hasattr(ctx, "kv_cache_clear"):
        ctx.kv_cache_clear()
    else:
        raise RuntimeError("no way to clear the KV cache in this llama-cpp-python")


def prefill_once(llm, ids):
    clear_cache(llm)
    t0 = time.perf_counter()
    llm.eval(ids)
    dt = time.perf_counter() - t0
    assert llm.n_tokens == len(ids), (llm.n_tokens, len(ids))
    return dt


def last_logits(llm):
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def decode_once(llm, prompt, steps):
    clear_cache(llm)
    llm.eval(prompt)
    nxt = int(np.argmax(last_logits(llm)))
    total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.eval([nxt])
        nxt = int(np.argmax(last_logits(llm)))
        total += time.perf_counter() - t0
    assert llm.n_tokens == len(prompt) + steps, llm.n_tokens
    return total


def mean_std(xs):
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-prompt", default="512",
                    help="comma-separated prompt lengths, e.g. 512,2048")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--flash-attn", action="store_true",
                    help="flash attention on (llama-cpp-python's default is off)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n_prompts = [int(x) for x in args.n_prompt.split(",") if x.strip()]
    assert n_prompts and all(n > 0 for n in n_prompts), args.n_prompt

    sysinfo = llama_cpp.llama_print_system_info()
    if isinstance(sysinfo, bytes):
        sysinfo = sysinfo.decode(errors="replace")
    if "AMX_INT8 = 1" in sysinfo:
        print("warning: this llama.cpp build uses AMX; where the CPU advertises AMX but faults "
              "on it (SIGSEGV in ggml_backend_amx_mul_mat), rebuild without it "
              "(see scripts/requirements-ref.txt)", file=sys.stderr, flush=True)

    n_ctx = max([2048, PROMPT_TG + args.n_gen] + n_prompts)
    llm = llama_cpp.Llama(
        model_path=args.gguf, n_ctx=n_ctx, n_batch=N_BATCH, n_ubatch=N_BATCH,
        n_threads=args.threads, n_threads_batch=args.threads,
        n_gpu_layers=0, flash_attn=args.flash_attn, logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()
    rng = np.random.default_rng(0)

    def draw(n):
        return rng.integers(100, n_vocab, size=n).tolist()

    rows, res = [], {}
    for n in n_prompts:
        prefill_once(llm, draw(n))  # warm-up
        pp = [n / prefill_once(llm, draw(n)) for _ in range(args.reps)]
        m, s = mean_std(pp)
        rows.append((f"pp{n}", m, s))
        res[f"pp{n}_ts"], res[f"pp{n}_std"] = m, s

    prompt = draw(PROMPT_TG)
    decode_once(llm, prompt, args.n_gen)  # warm-up
    tg = [args.n_gen / decode_once(llm, prompt, args.n_gen) for _ in range(args.reps)]
    m, s = mean_std(tg)
    rows.append((f"tg{args.n_gen}", m, s))
    res[f"tg{args.n_gen}_ts"], res[f"tg{args.n_gen}_std"] = m, s

    gname = os.path.basename(args.gguf)
    print(f"llama-cpp-python {llama_cpp.__version__} (llama.cpp), GGUF weights as stored, "
          f"CPU, threads={args.threads}, n_batch=n_ubatch={N_BATCH}, "
          f"flash_attn={'on' if args.flash_attn else 'off'}, {gname}")
    print()
    print("| test | t/s |")
    print("| --- | ---: |")
    for name, m, s in rows:
        print(f"| {name} | {m:.2f} ± {s:.2f} |")
    if args.json:
        res.update({
            "threads": args.threads, "llama_cpp_python": llama_cpp.__version__,
            "reps": args.reps, "n_batch": N_BATCH, "n_ubatch": N_BATCH, "n_ctx": n_ctx,
            "flash_attn": args.flash_attn,
            "model": gname, "system_info": sysinfo.strip(),
        })
        print(json.dumps(res))


if __name__ == "__main__":
    main()
