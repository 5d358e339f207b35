//! Checks against the real SmolLM2-135M-Instruct Q4_1 GGUF and goldens from transformers / python gguf.
//!
//! The model is not in git: `cargo run --release -- fetch smollm2-135m` puts it in models/cache
//! or `$RIDGEFILL_CACHE` (CI does this first). `RIDGEFILL_SMOLLM2_GGUF` overrides the path.

use std::path::{Path, PathBuf};

use ridgefill_io::checkpoint::{Checkpoint, CheckpointFormat};
use ridgefill_io::gguf::GgufFile;
use serde::Deserialize;

const MODEL_ENV: &str = "RIDGEFILL_SMOLLM2_GGUF";
const SMOLLM2: &str = "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The second model some dequant goldens refer to (fetched by scripts/test.sh; required).
const GEMMA_ENV: &str = "RIDGEFILL_GEMMA3_GGUF";
const GEMMA3: &str = "gemma3-270m/gemma-3-270m-q4_k_m.gguf";
const DEQUANT_GOLDEN: &str = "tests/golden/dequant.json";
/// numpy sums pairwise in f64 and we sum sequentially; both are far more precise than this.
const SUM_REL_TOLERANCE: f64 = 1e-9;

fn manifest_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn model_path() -> PathBuf {
    ridgefill_testkit::fetched_model(SMOLLM2, Some(MODEL_ENV))
}

fn gemma_path() -> PathBuf {
    ridgefill_testkit::fetched_model(GEMMA3, Some(GEMMA_ENV))
}

fn read_json<T: for<'de> Deserialize<'de>>(rel: &str) -> T {
    let path = manifest_path(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[derive(Deserialize)]
struct DequantGolden {
    real: Vec<RealRecord>,
}

#[derive(Deserialize)]
struct RealRecord {
    model: String,
    tensor: String,
    #[serde(rename = "type")]
    type_name: String,
    shape_ne: Vec<u64>,
    n_elements: u64,
    first_values: Vec<f64>,
    sum: f64,
    sumsq: f64,
}

fn open() -> Checkpoint {
    let path = model_path();
    Checkpoint::open(&path).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn tokenizer_matches_transformers() {
    let ckpt = open();
    let golden = ridgefill_testkit::golden::smollm2();
    let tok = &ckpt.tokenizer;
    for case in &golden.tokenizer {
        let plain = tok.encode(&case.text, false).unwrap();
        assert_eq!(
            plain, case.ids_no_special,
            "ids without specials for {:?}",
            case.text
        );
        let default = tok.encode(&case.text, true).unwrap();
        assert_eq!(default, case.ids_default, "default ids for {:?}", case.text);
        assert_eq!(
            tok.decode(&default, false).unwrap(),
            case.decoded,
            "decode of {:?}",
            case.text
        );
        let mut stream = tok.stream_decoder(false);
        let mut streamed = String::new();
        for &id in &default {
            if let Some(piece) = stream.push(id).unwrap() {
                streamed.push_str(&piece);
            }
        }
        assert_eq!(streamed, case.decoded, "streamed decode of {:?}", case.text);
    }
    assert_eq!(tok.bos_id(), Some(1));
    assert!(tok.eos_ids().contains(&2), "eos ids {:?}", tok.eos_ids());
    assert_eq!(tok.vocab_size(), 49152);
    assert!(!tok.add_bos());
}

#[test]
fn chat_template_matches_transformers() {
    let ckpt = open();
    let golden = ridgefill_testkit::golden::smollm2();
    let tmpl = ckpt
        .chat_template
        .as_ref()
        .expect("SmolLM2 GGUF has a chat template");
    let rendered = tmpl
        .render(&golden.chat.messages, golden.chat.add_generation_prompt)
        .unwrap();
    assert_eq!(rendered, golden.chat.chat_rendered);
    assert_eq!(
        ckpt.tokenizer.encode(&rendered, true).unwrap(),
        golden.chat.chat_rendered_ids
    );
}

#[test]
fn config_and_tensors() {
    let ckpt = open();
    assert_eq!(ckpt.format, CheckpointFormat::Gguf);
    let c = &ckpt.config;
    assert_eq!(c.architectures, vec!["LlamaForCausalLM".to_string()]);
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.num_hidden_layers),
        (576, 1536, 30)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim()),
        (9, 3, 64)
    );
    assert_eq!((c.vocab_size, c.max_position_embeddings), (49152, 8192));
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert!(c.tie_word_embeddings);
    assert!(c.rope_scaling.is_none());
    // 30 layers x 9 tensors + embeddings + final norm.
    assert_eq!(ckpt.tensor_names().len(), 272);
    let q = ckpt
        .tensor_info("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(
        (q.shape.clone(), q.dtype.as_str()),
        (vec![576, 576], "Q4_1")
    );
    let k = ckpt
        .tensor_info("model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(k.shape, vec![192, 576]);
    assert_eq!(
        ckpt.tensor_f32("model.layers.29.self_attn.k_proj.weight")
            .unwrap()
            .len(),
        192 * 576
    );
    assert!(!ckpt.has_tensor("lm_head.weight"));
    let fp = ckpt.weights_fingerprint();
    assert_eq!(fp.len(), 16);
    assert_eq!(fp, ckpt.weights_fingerprint());
}

#[test]
fn dequant_matches_python_gguf_on_real_tensors() {
    let golden: DequantGolden = read_json(DEQUANT_GOLDEN);
    let smol = model_path();
    let gemma = gemma_path();
    let mut checked = 0;
    for rec in &golden.real {
        let path = if smol.file_name().is_some_and(|f| f == rec.model.as_str()) {
            smol.clone()
        } else if gemma.file_name().is_some_and(|f| f == rec.model.as_str()) {
            gemma.clone()
        } else {
            panic!(
                "{} / {}: the golden file names a model this test does not know",
                rec.model, rec.tensor
            );
        };
        let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
        let info = file
            .tensor_info(&rec.tensor)
            .unwrap_or_else(|| panic!("{} missing", rec.tensor));
        assert_eq!(info.ggml_type.name(), rec.type_name, "{}", rec.tensor);
        assert_eq!(info.ne, rec.shape_ne, "{}", rec.tensor);
        assert_eq!(info.n_elements(), rec.n_elements, "{}", rec.tensor);
        let values = file.dequantize(&rec.tensor).unwrap();
        for (i, (&got, &want)) in values.iter().zip(&rec.first_values).enumerate() {
            assert_eq!(
                got.to_bits(),
                (want as f32).to_bits(),
                "{} element {i}",
                rec.tensor
            );
        }
        let (sum, sumsq) = values.iter().fold((0.0f64, 0.0f64), |(s, q), &v| {
            let v = f64::from(v);
            (s + v, q + v * v)
        });
        let close = |a: f64, b: f64| (a - b).abs() <= SUM_REL_TOLERANCE * b.abs().max(1.0);
        assert!(
            close(sum, rec.sum),
            "{} sum {sum} vs {}",
            rec.tensor,
            rec.sum
        );
        assert!(
            close(sumsq, rec.sumsq),
            "{} sumsq {sumsq} vs {}",
            rec.tensor,
            rec.sumsq
        );
        checked += 1;
    }
    assert!(
        checked >= 3,
        "expected the SmolLM2 records to be checked, checked {checked}"
    );
}
