#!/usr/bin/env python3
"""Tiny random-weight Qwen2 and Qwen3 models (HF safetensors + GGUF) and their golden logits.

What it does
  Builds two tiny models with transformers' own classes and a fixed seed:
    qwen2: Qwen2ForCausalLM  - q/k/v biases (o_proj none), untied lm_head,
           head_dim = hidden / heads = 16
    qwen3: Qwen3ForCausalLM  - q/k RMSNorm over head_dim (before RoPE), no
           biases, head_dim set explicitly to 32 (!= hidden / heads = 16), untied lm_head
  both: hidden 64, 2 layers, 4 query heads / 2 KV heads, intermediate 128,
  SiLU-gated MLP, RMSNorm eps 1e-6, RoPE base 1e6 (NeoX/half-split rotation),
  vocab 264 = 256 byte tokens (id b = GPT-2 byte-level symbol of byte b), 5 merges
  (MERGES: ids 256..260 = "Ġt", "he", "Ġthe", "in", "Ġa") and the control
  tokens <|endoftext|> 261, <|im_start|> 262, <|im_end|> 263. All parameters are
  redrawn from a seeded normal distribution (transformers' own init zeroes
  the biases and sets the norms to one, which would hide bugs there).
  Writes, for each NAME in (qwen2, qwen3):
    tests/data/tiny-NAME/config.json, model.safetensors (transformers'
        save_pretrained, float32), generation_config.json, tokenizer.json,
        tokenizer_config.json (byte-level BPE, Qwen2 split regex, ChatML template);
        config.json has rope_parameters (transformers 5) and the legacy rope_theta
    tests/data/tiny-NAME/tiny-NAME-f32.gguf  (gguf package; architecture
        `qwen2` / `qwen3`, llama.cpp tensor names and metadata keys, all F32,
        tokenizer.ggml.model "gpt2", pre "qwen2", the same tokens and merges)
  and tests/golden/tiny_qwen.json: per model the token ids, the full
  last-position logits of SEQ_LONG, the logits at every position of
  SEQ_SHORT, an 8-token greedy continuation, tokenizer cases (identical from
  tokenizer.json and from the GGUF, checked) and the rendered chat template.

How to run (from the repository root)
    .venv-ref/bin/pip install -r scripts/requirements-ref.txt
    .venv-ref/bin/python scripts/tiny_qwen.py          # a few seconds; no network

GGUF layout (what llama.cpp's convert_hf_to_gguf.py writes for these
architectures): Q and K are NOT permuted for qwen2/qwen3 (only the llama
architecture gets the interleaved-RoPE permutation; qwen2/qwen3 use NeoX
RoPE on the HF row order), and transformers' GGUF loader does not un-permute
them either (its LlamaTensorProcessor is only registered for "llama").
Every tensor is stored with the HF [out, in] row-major layout, which GGUF
lists as shape [in, out] (ne0 first). Names:
    token_embd.weight, output_norm.weight, output.weight,
    blk.N.attn_norm.weight, blk.N.attn_{q,k,v}.weight, blk.N.attn_output.weight,
    blk.N.attn_{q,k,v}.bias (qwen2), blk.N.attn_{q,k}_norm.weight (qwen3),
    blk.N.ffn_norm.weight, blk.N.ffn_{gate,up,down}.weight
Metadata: ARCH.{context_length, embedding_length, block_count,
feed_forward_length, attention.head_count, attention.head_count_kv,
rope.freq_base, attention.layer_norm_rms_epsilon}; qwen3 adds
ARCH.attention.{key_length,value_length} (= head_dim, as the converter
writes when config.json has head_dim).

Verified by this script (it fails loudly otherwise): transformers loads each
GGUF back (`gguf_file=`) and its logits equal the HF folder's (max abs diff
reported in the golden file; 0 with these versions), and the tokenizer it
builds from the GGUF gives the same ids as tokenizer.json on TOKENIZER_CASES.
Caveat: transformers 5.24's GGUF config mapping for qwen3 ignores
attention.key_length and falls back to Qwen3Config's default head_dim (128):
loading the qwen3 GGUF without help fails with a size mismatch. The script
therefore passes head_dim=32 (the GGUF's key_length) when loading it back.
Real Qwen3 checkpoints all have head_dim 128, which is why this goes unnoticed.
"""
import argparse
import hashlib
import importlib.metadata
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 1234
MERGES = [("\u0120", "t"), ("h", "e"), ("\u0120t", "he"), ("i", "n"), ("\u0120", "a")]
SPECIALS = {"<|endoftext|>": 261, "<|im_start|>": 262, "<|im_end|>": 263}
VOCAB = 256 + len(MERGES) + len(SPECIALS)
EOT = SPECIALS["<|endoftext|>"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
              bos_token_id=EOT, eos_token_id=EOT, pad_token_id=EOT)
ROPE_THETA = 1_000_000.0
QWEN3_HEAD_DIM = 32

SEQ_LONG = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 262, 0, 255,
            128, 258, 31, 58, 261, 260, 77]        # 24 ids: full last-position logits
SEQ_SHORT = [262, 117, 115, 101, 114, 10, 104, 105]  # 8 ids: logits at every position
TOKENIZER_CASES = ["Hello, world!", "the then in a tin at the end", "  two  spaces\n\nand lines",
                   "wörld 😀 123456", "<|im_start|>user\nhi<|im_end|>\n", "It's 2024's"]
GREEDY_NEW = 8
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                 "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def f32list(t):
    return [float(x) for x in t.detach().to(torch.float32).cpu().numpy().reshape(-1).tolist()]


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def byte_tokens():
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    b2u = bytes_to_unicode()
    return [b2u[b] for b in range(256)]


def all_tokens():
    return byte_tokens() + [a + b for a, b in MERGES] + list(SPECIALS)


def build_model(name):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    if name == "qwen2":
        cfg = Qwen2Config(**COMMON, rope_parameters=rope, use_sliding_window=False)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = Qwen3Config(**COMMON, rope_parameters=rope, head_dim=QWEN3_HEAD_DIM,
                          attention_bias=False, use_sliding_window=False)
        model = Qwen3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(SEED + (0 if name == "qwen2" else 1))
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif pname.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif pname == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # [out, in] matrices
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[1] ** 0.5))
    model.eval()
    return model


def write_hf(model, folder):
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    model.save_pretrained(folder, safe_serialization=True)
    os.chmod(os.path.join(folder, "model.safetensors"), 0o644)
    # transformers 5 writes rope_parameters only; hub checkpoints carry the legacy top-level
    # rope_theta, so write both (transformers reads either; the reload below checks it).
    cpath = os.path.join(folder, "config.json")
    with open(cpath, encoding="utf-8") as f:
        cj = json.load(f)
    cj["rope_theta"] = ROPE_THETA
    with open(cpath, "w", encoding="utf-8") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")
    vocab = {t: i for i, t in enumerate(all_tokens()[:256 + len(MERGES)])}
    tok = Tokenizer(BPE(vocab=vocab, merges=list(MERGES), byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    assert all(tok.token_to_id(s) == i for s, i in SPECIALS.items())
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
                   "bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "unk_token": None, "chat_template": CHAT_TEMPLATE, "model_max_length": 128,
                   "clean_up_tokenization_spaces": False}, f, indent=1)
        f.write("\n")


def write_gguf(model, name, path):
    import gguf
    cfg = model.config
    sd = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(path, name)
    w.add_name(f"tiny-{name}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if name == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    # tokenizer: byte-level BPE, the 256 byte symbols, MERGES and 3 control tokens
    tokens = all_tokens()
    types = [gguf.TokenType.NORMAL] * (256 + len(MERGES)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(EOT)
    w.add_eos_token_id(EOT)
    w.add_pad_token_id(EOT)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
                 "self_attn.o_proj.weight": "attn_output.weight",
                 "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight",
                 "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    missing = sorted(set(sd) - set(names))
    assert not missing, f"unmapped tensors: {missing}"
    table = {}
    for hf, gg in names.items():
        if hf not in sd:
            continue
        arr = np.ascontiguousarray(sd[hf], dtype=np.float32)
        w.add_tensor(gg, arr)  # numpy [out, in] -> GGUF shape [in, out]; no Q/K permutation
        table[gg] = {"hf": hf, "gguf_shape": list(reversed(arr.shape)), "type": "F32"}
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return table


@torch.no_grad()
def logits_of(model, ids):
    return model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0].to(torch.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", default=os.path.join(ROOT, "tests/data"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/golden/tiny_qwen.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {
        "schema_version": 1,
        "reference": {"torch": torch.__version__, "transformers": transformers.__version__,
                      "gguf": importlib.metadata.version("gguf"), "dtype": "float32", "device": "cpu"},
        "seq_long": SEQ_LONG, "seq_short": SEQ_SHORT,
        "tolerance_note": "logits within 1e-4 of transformers",
        "models": {},
    }
    for name in ("qwen2", "qwen3"):
        folder = os.path.join(args.data_dir, f"tiny-{name}")
        os.makedirs(folder, exist_ok=True)
        model = build_model(name)
        write_hf(model, folder)
        gguf_name = f"tiny-{name}-f32.gguf"
        gguf_path = os.path.join(folder, gguf_name)
        table = write_gguf(model, name, gguf_path)

        # reload both ways and compare
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        extra = {"head_dim": model.config.head_dim} if name == "qwen3" else {}
        gg = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32,
                                                  **extra).eval()
        assert gg.config.model_type == name, gg.config.model_type
        assert bool(gg.config.tie_word_embeddings) is False
        la, lb, lc = logits_of(model, SEQ_LONG), logits_of(hf, SEQ_LONG), logits_of(gg, SEQ_LONG)
        sa, sb, sc = logits_of(model, SEQ_SHORT), logits_of(hf, SEQ_SHORT), logits_of(gg, SEQ_SHORT)
        d_hf = max(float((la - lb).abs().max()), float((sa - sb).abs().max()))
        d_gguf = max(float((la - lc).abs().max()), float((sa - sc).abs().max()))
        print(f"{name}: max|built-hf| {d_hf:.3g}  max|built-gguf| {d_gguf:.3g}", file=sys.stderr)
        assert d_hf <= 1e-6 and d_gguf <= 1e-6, (d_hf, d_gguf)

        with torch.no_grad():
            x = torch.tensor([SEQ_SHORT])
            gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=GREEDY_NEW, min_new_tokens=GREEDY_NEW, num_beams=1,
                              repetition_penalty=1.0, pad_token_id=EOT,
                              output_scores=True, return_dict_in_generate=True)
        new = gen.sequences[0, len(SEQ_SHORT):].tolist()
        margins = [float((lambda t: t[0] - t[1])(torch.topk(s[0], 2).values)) for s in gen.scores]

        tok = AutoTokenizer.from_pretrained(folder)
        tok_gguf = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
        tcases = []
        for s in TOKENIZER_CASES:
            a = tok(s)["input_ids"]
            b = tok_gguf(s)["input_ids"]
            assert a == b, (name, s, a, b)
            tcases.append({"text": s, "ids": a, "decoded": tok.decode(a)})
        rendered = tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
        cfg = model.config
        out["models"][name] = {
            "hf_folder": f"tests/data/tiny-{name}",
            "gguf": f"tests/data/tiny-{name}/{gguf_name}",
            "gguf_sha256": sha256_file(gguf_path),
            "safetensors_sha256": sha256_file(os.path.join(folder, "model.safetensors")),
            "config": {"architecture": name, "hidden_size": cfg.hidden_size,
                       "num_layers": cfg.num_hidden_layers, "num_heads": cfg.num_attention_heads,
                       "num_kv_heads": cfg.num_key_value_heads,
                       "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                       "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
                       "rope_theta": ROPE_THETA, "rms_norm_eps": cfg.rms_norm_eps,
                       "qkv_bias": name == "qwen2", "qk_norm": name == "qwen3",
                       "tie_word_embeddings": False, "seed": SEED},
            "gguf_tensors": table,
            "check": {"max_abs_diff_hf_folder": d_hf, "max_abs_diff_gguf_via_transformers": d_gguf},
            "logits_long_last": f32list(la[-1]),
            "argmax_long_last": int(torch.argmax(la[-1])),
            "logits_short_all": [f32list(sa[t]) for t in range(sa.shape[0])],
            "argmax_short": [int(i) for i in torch.argmax(sa, dim=-1)],
            "greedy_short": {"max_new_tokens": GREEDY_NEW, "ids": new, "top2_margins": margins},
            "tokenizer": {"bos_added_by_default": False, "specials": SPECIALS,
                          "merges": [f"{a} {b}" for a, b in MERGES], "cases": tcases},
            "chat": {"messages": CHAT_MESSAGES, "add_generation_prompt": True,
                     "template": CHAT_TEMPLATE, "rendered": rendered,
                     "rendered_ids": tok(rendered, add_special_tokens=False)["input_ids"]},
        }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
