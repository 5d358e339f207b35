//! A tiny random Llama written both as GGUF (llama.cpp conventions) and as a HF directory.

use std::path::Path;

use half::{bf16, f16};
use ridgefill_io::gguf::writer::GgufWriter;
use ridgefill_io::gguf::{MetaArray, MetaValue};
use ridgefill_io::quant::GgmlType;
use safetensors::tensor::{Dtype, TensorView};
use tokenizers::AddedToken;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;

pub const HIDDEN: usize = 64;
pub const INTERMEDIATE: usize = 96;
pub const LAYERS: usize = 2;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = HIDDEN / HEADS;
pub const CONTEXT: usize = 128;
pub const RMS_EPS: f32 = 1e-5;
pub const ROPE_THETA: f32 = 10000.0;
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const BOS_ID: u32 = 1;
pub const EOS_ID: u32 = 2;
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
const MERGES: [(&str, &str); 6] = [
    ("h", "e"),
    ("Ġ", "t"),
    ("Ġt", "he"),
    ("l", "l"),
    ("Ġ", "w"),
    ("o", "r"),
];
const Q8_BLOCK: usize = 32;
const Q8_MAX: f32 = 127.0;
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_CONTROL: i32 = 3;

/// How a tensor is stored on each side.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Store {
    F32,
    F16,
    Bf16,
    Q8_0,
}

pub struct TinyTensor {
    pub hf_name: String,
    pub gguf_name: String,
    pub hf_shape: Vec<usize>,
    /// Exact values in HF layout (already rounded to what the stores can represent).
    pub values: Vec<f32>,
    pub hf_store: Store,
    pub gguf_store: Store,
    /// Q8_0 bytes in HF row order (only for Q8_0 GGUF stores).
    pub q8_raw: Vec<u8>,
    /// Heads to permute with, for llama.cpp's Q/K row permutation.
    pub permute_heads: Option<usize>,
}

pub struct Tiny {
    pub tensors: Vec<TinyTensor>,
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    pub token_types: Vec<i32>,
    pub tokenizer: tokenizers::Tokenizer,
}

/// xorshift64*: deterministic values without a rand dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// GPT-2's byte -> printable char table.
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

/// Q8_0 per row; returns raw bytes and the exact dequantised values.
fn quantize_q8_0(values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut raw = Vec::new();
    let mut deq = Vec::new();
    for block in values.chunks(Q8_BLOCK) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = f16::from_f32(amax / Q8_MAX);
        let df = d.to_f32();
        raw.extend_from_slice(&d.to_bits().to_le_bytes());
        for &v in block {
            let q = if df == 0.0 {
                0
            } else {
                (v / df).round().clamp(-Q8_MAX, Q8_MAX) as i8
            };
            raw.push(q as u8);
            deq.push(q as f32 * df);
        }
    }
    (raw, deq)
}

/// llama.cpp's converter: `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).reshape(w.shape)`.
pub fn llama_cpp_permute<T: Copy>(rows_data: &[T], rows: usize, n_head: usize) -> Vec<T> {
    let cols = rows_data.len() / rows;
    let half = rows / n_head / 2;
    let mut out = Vec::with_capacity(rows_data.len());
    // Output index order (h, j, s) reads input (h, s, j).
    for h in 0..n_head {
        for j in 0..half {
            for s in 0..2 {
                let src_row = (h * 2 + s) * half + j;
                out.extend_from_slice(&rows_data[src_row * cols..(src_row + 1) * cols]);
            }
        }
    }
    out
}

fn build_tokenizer() -> (tokenizers::Tokenizer, Vec<String>, Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    tokens.extend(byte_chars().into_iter().map(String::from));
    for (a, b) in MERGES {
        tokens.push(format!("{a}{b}"));
    }
    let mut vocab = Vocab::default();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.clone(), i as u32);
    }
    let merges: Vec<(String, String)> = MERGES
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges.clone())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ]))));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let specials: Vec<AddedToken> = SPECIALS
        .iter()
        .map(|s| AddedToken::from(s.to_string(), true))
        .collect();
    tok.add_special_tokens(&specials);
    let types = (0..tokens.len())
        .map(|i| {
            if i < SPECIALS.len() {
                TOKEN_TYPE_CONTROL
            } else {
                TOKEN_TYPE_NORMAL
            }
        })
        .collect();
    let merge_strs = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    (tok, tokens, merge_strs, types)
}

pub fn tiny() -> Tiny {
    let (tokenizer, tokens, merges, token_types) = build_tokenizer();
    let vocab = tokens.len();
    let mut rng = Rng::new(0x5eed);
    let mut tensors = Vec::new();
    let mut add = |hf: &str,
                   gg: &str,
                   shape: Vec<usize>,
                   hf_store: Store,
                   gguf_store: Store,
                   permute: Option<usize>| {
        let n: usize = shape.iter().product();
        let raw: Vec<f32> = (0..n).map(|_| rng.next_f32() * 0.5).collect();
        let rounded = |s: Store, v: Vec<f32>| -> Vec<f32> {
            match s {
                Store::F16 => v.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
                Store::Bf16 => v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
                _ => v,
            }
        };
        let (q8_raw, values) = if gguf_store == Store::Q8_0 {
            quantize_q8_0(&raw)
        } else {
            (Vec::new(), rounded(gguf_store, rounded(hf_store, raw)))
        };
        tensors.push(TinyTensor {
            hf_name: hf.into(),
            gguf_name: gg.into(),
            hf_shape: shape,
            values,
            hf_store,
            gguf_store,
            q8_raw,
            permute_heads: permute,
        });
    };
    let kv = KV_HEADS * HEAD_DIM;
    add(
        "model.embed_tokens.weight",
        "token_embd.weight",
        vec![vocab, HIDDEN],
        Store::F32,
        Store::Q8_0,
        None,
    );
    add(
        "model.norm.weight",
        "output_norm.weight",
        vec![HIDDEN],
        Store::F16,
        Store::F16,
        None,
    );
    add(
        "lm_head.weight",
        "output.weight",
        vec![vocab, HIDDEN],
        Store::F16,
        Store::F16,
        None,
    );
    for l in 0..LAYERS {
        let hf = |s: &str| format!("model.layers.{l}.{s}.weight");
        let gg = |s: &str| format!("blk.{l}.{s}.weight");
        add(
            &hf("input_layernorm"),
            &gg("attn_norm"),
            vec![HIDDEN],
            Store::Bf16,
            Store::F32,
            None,
        );
        add(
            &hf("post_attention_layernorm"),
            &gg("ffn_norm"),
            vec![HIDDEN],
            Store::F32,
            Store::F32,
            None,
        );
        add(
            &hf("self_attn.q_proj"),
            &gg("attn_q"),
            vec![HEADS * HEAD_DIM, HIDDEN],
            Store::F32,
            Store::Q8_0,
            Some(HEADS),
        );
        add(
            &hf("self_attn.k_proj"),
            &gg("attn_k"),
            vec![kv, HIDDEN],
            Store::F16,
            Store::F16,
            Some(KV_HEADS),
        );
        add(
            &hf("self_attn.v_proj"),
            &gg("attn_v"),
            vec![kv, HIDDEN],
            Store::F16,
            Store::F16,
            None,
        );
        add(
            &hf("self_attn.o_proj"),
            &gg("attn_output"),
            vec![HIDDEN, HEADS * HEAD_DIM],
            Store::F32,
            Store::F32,
            None,
        );
        add(
            &hf("mlp.gate_proj"),
            &gg("ffn_gate"),
            vec![INTERMEDIATE, HIDDEN],
            Store::F32,
            Store::Q8_0,
            None,
        );
        add(
            &hf("mlp.up_proj"),
            &gg("ffn_up"),
            vec![INTERMEDIATE, HIDDEN],
            Store::Bf16,
            Store::F32,
            None,
        );
        add(
            &hf("mlp.down_proj"),
            &gg("ffn_down"),
            vec![HIDDEN, INTERMEDIATE],
            Store::F32,
            Store::Q8_0,
            None,
        );
    }
    Tiny {
        tensors,
        tokens,
        merges,
        token_types,
        tokenizer,
    }
}

/// Options that break one thing on purpose.
#[derive(Default)]
pub struct Faults<'a> {
    /// HF name of a tensor to leave out.
    pub skip_tensor: Option<&'a str>,
    /// HF name of a tensor whose first dimension is cut by one row.
    pub short_tensor: Option<&'a str>,
    /// Leave out the tokenizer (tokenizer.json, or tokenizer.ggml.tokens).
    pub no_tokenizer: bool,
    /// Not a fault: write the HF weights as two shards plus model.safetensors.index.json.
    pub sharded: bool,
}

pub fn gguf_writer(t: &Tiny, faults: &Faults) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", "llama")
        .add_meta("general.name", "tiny")
        .add_meta("llama.block_count", LAYERS as u32)
        .add_meta("llama.context_length", CONTEXT as u32)
        .add_meta("llama.embedding_length", HIDDEN as u32)
        .add_meta("llama.feed_forward_length", INTERMEDIATE as u32)
        .add_meta("llama.attention.head_count", HEADS as u32)
        .add_meta("llama.attention.head_count_kv", KV_HEADS as u32)
        .add_meta("llama.attention.layer_norm_rms_epsilon", RMS_EPS)
        .add_meta("llama.rope.freq_base", ROPE_THETA)
        .add_meta("llama.rope.dimension_count", HEAD_DIM as u32)
        .add_meta("llama.vocab_size", t.tokens.len() as u32)
        .add_meta("tokenizer.ggml.model", "gpt2")
        .add_meta("tokenizer.ggml.pre", "smollm")
        .add_meta(
            "tokenizer.ggml.merges",
            MetaValue::Array(MetaArray::String(t.merges.clone())),
        )
        .add_meta("tokenizer.ggml.token_type", t.token_types.clone())
        .add_meta("tokenizer.ggml.bos_token_id", BOS_ID)
        .add_meta("tokenizer.ggml.eos_token_id", EOS_ID)
        .add_meta("tokenizer.ggml.add_bos_token", false)
        .add_meta("tokenizer.chat_template", CHAT_TEMPLATE)
        // A nested array and 64-bit values exercise the rarer value types.
        .add_meta(
            "test.nested",
            MetaValue::Array(MetaArray::Array(vec![
                MetaArray::U8(vec![1, 2]),
                MetaArray::U8(vec![]),
            ])),
        )
        .add_meta("test.i64", -5i64)
        .add_meta("test.f64", 0.25f64);
    if !faults.no_tokenizer {
        w.add_meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(MetaArray::String(t.tokens.clone())),
        );
    }
    for tt in &t.tensors {
        if faults.skip_tensor == Some(tt.hf_name.as_str()) {
            continue;
        }
        let ne: Vec<u64> = tt.hf_shape.iter().rev().map(|&d| d as u64).collect();
        let rows = tt.hf_shape[0];
        match tt.gguf_store {
            Store::Q8_0 => {
                let raw = match tt.permute_heads {
                    // Permuting whole rows of blocks equals quantising permuted rows.
                    Some(h) => llama_cpp_permute(&tt.q8_raw, rows, h),
                    None => tt.q8_raw.clone(),
                };
                w.add_tensor_raw(&tt.gguf_name, &ne, GgmlType::Q8_0, raw);
            }
            store => {
                let vals = match tt.permute_heads {
                    Some(h) => llama_cpp_permute(&tt.values, rows, h),
                    None => tt.values.clone(),
                };
                match store {
                    Store::F16 => w.add_tensor_f16(&tt.gguf_name, &ne, &vals),
                    _ => w.add_tensor_f32(&tt.gguf_name, &ne, &vals),
                };
            }
        }
    }
    w
}

pub fn write_gguf(t: &Tiny, path: &Path, faults: &Faults) {
    gguf_writer(t, faults).write(path).unwrap();
}

pub fn config_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": tiny_vocab(),
        "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": false,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "some_unknown_field": {"ignored": true}
    })
}

pub fn tiny_vocab() -> usize {
    SPECIALS.len() + 256 + MERGES.len()
}

pub fn write_hf_dir(t: &Tiny, dir: &Path, faults: &Faults) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&config_json()).unwrap(),
    )
    .unwrap();
    let tok_cfg = serde_json::json!({
        "bos_token": SPECIALS[BOS_ID as usize],
        "eos_token": {"content": SPECIALS[EOS_ID as usize], "special": true},
        "chat_template": [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "tool_use", "template": "x"}],
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec(&tok_cfg).unwrap(),
    )
    .unwrap();
    if !faults.no_tokenizer {
        t.tokenizer.save(dir.join("tokenizer.json"), false).unwrap();
    }
    let mut buffers: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for tt in &t.tensors {
        if faults.skip_tensor == Some(tt.hf_name.as_str()) {
            continue;
        }
        let mut shape = tt.hf_shape.clone();
        let mut values = tt.values.clone();
        if faults.short_tensor == Some(tt.hf_name.as_str()) {
            let cols = values.len() / shape[0];
            shape[0] -= 1;
            values.truncate(shape[0] * cols);
        }
        let (dtype, bytes): (Dtype, Vec<u8>) = match tt.hf_store {
            Store::F16 => (
                Dtype::F16,
                values
                    .iter()
                    .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
                    .collect(),
            ),
            Store::Bf16 => (
                Dtype::BF16,
                values
                    .iter()
                    .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
                    .collect(),
            ),
            _ => (
                Dtype::F32,
                values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
        };
        buffers.push((tt.hf_name.clone(), dtype, shape, bytes));
    }
    let views: Vec<(String, TensorView<'_>)> = buffers
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    if !faults.sharded {
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        return;
    }
    let files = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let half = views.len() / 2;
    let mut weight_map = serde_json::Map::new();
    let mut parts = vec![Vec::new(), Vec::new()];
    for (i, v) in views.into_iter().enumerate() {
        let shard = usize::from(i >= half);
        weight_map.insert(v.0.clone(), serde_json::json!(files[shard]));
        parts[shard].push(v);
    }
    for (file, part) in files.iter().zip(parts) {
        safetensors::serialize_to_file(part, None, &dir.join(file)).unwrap();
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// Text from a small word list the tiny tokenizer covers (calibration and prompt fixtures).
pub fn words(n: usize, seed: u64) -> String {
    const W: [&str; 12] = [
        "the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", ".",
    ];
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| W[((rng.next_f32() + 1.0) * 6.0) as usize % W.len()])
        .collect::<Vec<_>>()
        .join(" ")
}
