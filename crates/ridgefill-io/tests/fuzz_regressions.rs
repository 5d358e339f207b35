//! Every input under `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` goes through the
//! same entry point its `cargo fuzz` target calls (`ridgefill_io::fuzzing`); none may panic.
//!
//! `cargo test -p ridgefill-io --test fuzz_regressions -- --ignored write_fuzz_seeds` rewrites
//! the small valid seed files under `fuzz/seeds/<target>/`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use ridgefill_io::fill::{
    AlphaTrial, FEATURE_KIND, FILL_FORMAT_VERSION, FillDtype, FillFile, FillMeta, LayerQuality,
    ModelFingerprint,
};
use ridgefill_io::fuzzing::{SEPARATOR, TARGETS};
use ridgefill_io::gguf::writer::GgufWriter;
use ridgefill_io::gguf::{MetaArray, MetaValue};
use ridgefill_io::quant::GgmlType;
use ridgefill_io::stats::{Moments, STATS_FORMAT_VERSION, StatsFile, StatsMeta};

/// libFuzzer runs targets on the main thread; give each input a main-thread-sized stack.
const STACK_BYTES: usize = 8 << 20;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

#[test]
fn fuzz_corpus_and_regressions_do_not_panic() {
    let root = fuzz_dir();
    let mut ran = 0usize;
    let mut failures = Vec::new();
    for kind in ["corpus", "regressions", "seeds"] {
        for &(name, entry) in TARGETS {
            for file in files_under(&root.join(kind).join(name)) {
                // A running fuzzer replaces corpus files as it reduces them.
                let Ok(data) = std::fs::read(&file) else {
                    continue;
                };
                let outcome = std::thread::Builder::new()
                    .stack_size(STACK_BYTES)
                    .spawn(move || catch_unwind(AssertUnwindSafe(|| entry(&data))).is_ok())
                    .unwrap()
                    .join();
                if !matches!(outcome, Ok(true)) {
                    failures.push(file.display().to_string());
                }
                ran += 1;
            }
        }
    }
    assert!(failures.is_empty(), "panicked on: {failures:#?}");
    assert!(ran > 0, "no inputs found under {}", root.display());
}

#[test]
fn every_target_has_a_fuzz_target_file() {
    for &(name, _) in TARGETS {
        let file = fuzz_dir().join("fuzz_targets").join(format!("{name}.rs"));
        let src = std::fs::read_to_string(&file).unwrap();
        assert!(
            src.contains(&format!("fuzzing::{name}(")),
            "{}",
            file.display()
        );
    }
}

/// Bytes with no f16 NaN/infinity anywhere (every byte < 0x7C), so quant scales stay finite.
fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11) % 0x7b) as u8)
        .collect()
}

fn f32s(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 13 + seed * 7) % 17) as f32 * 0.05 - 0.4)
        .collect()
}

/// A 1-layer Llama small enough to be a fuzz seed: hidden 8, 2 heads of 4, 1 KV head, a
/// 7-token BPE vocabulary, plus one extra tensor of every dequantisable type.
fn micro_gguf(version: u32, tied: bool, extras: bool) -> Vec<u8> {
    let (h, inter, heads, kv_heads, hd) = (8u64, 16u64, 2u32, 1u32, 4u64);
    let tokens = vec!["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab"];
    let mut w = GgufWriter::new();
    w.version(version)
        .add_meta("general.architecture", "llama")
        .add_meta("llama.block_count", 1u32)
        .add_meta("llama.context_length", 32u32)
        .add_meta("llama.embedding_length", h as u32)
        .add_meta("llama.feed_forward_length", inter as u32)
        .add_meta("llama.attention.head_count", heads)
        .add_meta("llama.attention.head_count_kv", kv_heads)
        .add_meta("llama.attention.layer_norm_rms_epsilon", 1e-5f32)
        .add_meta("llama.rope.freq_base", 10000.0f32)
        .add_meta("llama.rope.dimension_count", hd as u32)
        .add_meta("tokenizer.ggml.model", "gpt2")
        .add_meta("tokenizer.ggml.pre", "default")
        .add_meta("tokenizer.ggml.tokens", tokens.clone())
        .add_meta("tokenizer.ggml.merges", vec!["a b", "Ġ ab"])
        .add_meta("tokenizer.ggml.token_type", vec![3i32, 3, 1, 1, 1, 1, 1])
        .add_meta("tokenizer.ggml.bos_token_id", 0u32)
        .add_meta("tokenizer.ggml.eos_token_id", 1u32)
        .add_meta(
            "tokenizer.chat_template",
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        );
    if extras {
        w.add_meta("general.alignment", 64u32)
            .add_meta(
                "test.nested",
                MetaValue::Array(MetaArray::Array(vec![
                    MetaArray::U8(vec![1, 2]),
                    MetaArray::F64(vec![0.5]),
                ])),
            )
            .add_meta("test.i64", -5i64)
            .add_meta("test.bool", true)
            .add_meta("test.u16", 7u16);
    }
    let v = tokens.len() as u64;
    let q = u64::from(heads) * hd;
    let kv = u64::from(kv_heads) * hd;
    let mut seed = 0;
    let mut f = |w: &mut GgufWriter, name: &str, ne: &[u64]| {
        seed += 1;
        let n = ne.iter().product::<u64>() as usize;
        if seed % 2 == 0 {
            w.add_tensor_f16(name, ne, &f32s(n, seed));
        } else {
            w.add_tensor_f32(name, ne, &f32s(n, seed));
        }
    };
    f(&mut w, "token_embd.weight", &[h, v]);
    f(&mut w, "output_norm.weight", &[h]);
    if !tied {
        f(&mut w, "output.weight", &[h, v]);
    }
    f(&mut w, "blk.0.attn_norm.weight", &[h]);
    f(&mut w, "blk.0.ffn_norm.weight", &[h]);
    f(&mut w, "blk.0.attn_q.weight", &[h, q]);
    f(&mut w, "blk.0.attn_k.weight", &[h, kv]);
    f(&mut w, "blk.0.attn_v.weight", &[h, kv]);
    f(&mut w, "blk.0.attn_output.weight", &[q, h]);
    f(&mut w, "blk.0.ffn_gate.weight", &[h, inter]);
    f(&mut w, "blk.0.ffn_up.weight", &[h, inter]);
    f(&mut w, "blk.0.ffn_down.weight", &[inter, h]);
    if extras {
        for (i, ty) in [
            GgmlType::BF16,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ]
        .into_iter()
        .enumerate()
        {
            let n = ty.block_size() as u64;
            let bytes = ty.bytes_for(n).unwrap() as usize;
            w.add_tensor_raw(&format!("extra.{ty}"), &[n], ty, pattern(bytes, i));
        }
    }
    w.to_bytes(Path::new("seed.gguf")).unwrap()
}

fn micro_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
        "vocab_size": 7,
        "max_position_embeddings": 32,
        "tie_word_embeddings": true,
        "eos_token_id": [1, 2]
    })
}

fn micro_safetensors() -> Vec<u8> {
    use safetensors::tensor::{Dtype, TensorView};
    let f32_bytes: Vec<u8> = f32s(8 * 7, 1)
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let f16_bytes: Vec<u8> = f32s(8, 2)
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect();
    let bf16_bytes: Vec<u8> = f32s(4 * 8, 3)
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect();
    let views = vec![
        (
            "model.embed_tokens.weight",
            TensorView::new(Dtype::F32, vec![7, 8], &f32_bytes).unwrap(),
        ),
        (
            "model.norm.weight",
            TensorView::new(Dtype::F16, vec![8], &f16_bytes).unwrap(),
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            TensorView::new(Dtype::BF16, vec![4, 8], &bf16_bytes).unwrap(),
        ),
    ];
    safetensors::serialize(views, None).unwrap()
}

fn fingerprint() -> ModelFingerprint {
    ModelFingerprint {
        architecture: "llama".into(),
        hidden_size: 3,
        num_hidden_layers: 2,
        num_key_value_heads: 1,
        head_dim: 2,
        vocab_size: 5,
        weights_hash: "0123456789abcdef".into(),
    }
}

fn micro_fill(dir: &Path, dtype: FillDtype) -> Vec<u8> {
    let m = fingerprint();
    let file = FillFile {
        meta: FillMeta {
            format_version: FILL_FORMAT_VERSION,
            model: m.clone(),
            split: 1,
            sink: 1,
            feature: FEATURE_KIND.into(),
            alpha: 1e-3,
            lambda: 0.25,
            calib_tokens: 10,
            calib_sources: vec!["a.txt".into()],
            heldout_tokens: 5,
            quality: vec![LayerQuality {
                layer: 1,
                r2_k: 0.9,
                r2_v: 0.8,
            }],
            heldout_kl: Some(0.01),
            alpha_grid: vec![AlphaTrial {
                alpha: 1e-3,
                lambda: 0.25,
                kl: 0.01,
            }],
            created_by: "seed".into(),
            method: Default::default(),
            split_search: Vec::new(),
        },
        k: vec![f32s((m.hidden_size + 1) * m.kv_dim(), 1)],
        v: vec![f32s((m.hidden_size + 1) * m.kv_dim(), 2)],
        precision: None,
    };
    let path = dir.join("seed.fill");
    file.write(&path, dtype).unwrap();
    std::fs::read(&path).unwrap()
}

fn micro_stats(dir: &Path) -> Vec<u8> {
    let meta = StatsMeta {
        format_version: STATS_FORMAT_VERSION,
        model: fingerprint(),
        split: 1,
        sink: 1,
        feature: FEATURE_KIND.into(),
        ctx: 16,
        sources: vec!["a.txt".into()],
    };
    let (f, c) = (meta.features(), meta.cols());
    let mut fit = Moments::zeros(f, c);
    fit.rows = 3;
    fit.xtx
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = i as f64);
    let file = StatsFile {
        meta,
        fit,
        heldout: Moments::zeros(f, c),
    };
    let path = dir.join("seed.stats");
    file.write(&path).unwrap();
    std::fs::read(&path).unwrap()
}

fn joined(parts: &[&[u8]]) -> Vec<u8> {
    parts.join(&SEPARATOR)
}

#[test]
#[ignore = "writes fuzz/seeds; run by hand when the formats change"]
fn write_fuzz_seeds() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = serde_json::to_vec(&micro_config()).unwrap();
    let brown = "The/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd Friday/nr an/at \
                 investigation/nn of/in Atlanta's/np$ recent/jj primary/nn election/nn produced/vbd \
                 ``/`` no/at evidence/nn ''/'' that/cs any/dti irregularities/nns took/vbd place/nn ./.\n";
    let seeds: Vec<(&str, &str, Vec<u8>)> = vec![
        ("gguf", "micro_v3.gguf", micro_gguf(3, false, false)),
        ("gguf", "micro_v2_tied_extras.gguf", micro_gguf(2, true, true)),
        ("safetensors_hf", "micro", joined(&[&cfg, &micro_safetensors()])),
        ("fill", "micro_f32.fill", micro_fill(tmp.path(), FillDtype::F32)),
        ("fill", "micro_f16.fill", micro_fill(tmp.path(), FillDtype::F16)),
        ("fill", "micro.stats", micro_stats(tmp.path())),
        ("text", "plain.txt", b"\x00\xef\xbb\xbfna\xc3\xafve caf\xc3\xa9 and/or\n".to_vec()),
        ("text", "brown_lossy.txt", [b"\x01".as_slice(), brown.as_bytes(), b"\xff"].concat()),
        (
            "chat_template",
            "inline",
            joined(&[
                b"\x02{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}\
                  {% set ns.n = ns.n + 1 %}{% endif %}{{ m.role | upper }}: {{ m.content.strip() }}\
                  {{ {'k': [1, m.content]} | tojson }}{% endfor %}{{ strftime_now('%d %b %Y') }}\
                  {% if add_generation_prompt %}{{ bos_token }}{% endif %}{{ ns.n }}",
                b"system",
                b"be brief",
                b"user",
                b"  hello  ",
            ]),
        ),
        (
            "chat_template",
            "shipped",
            joined(&[b"\x03user", b"hi", b"assistant", b"hello"]),
        ),
    ];
    for (target, name, bytes) in seeds {
        let dir = fuzz_dir().join("seeds").join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// The seeds are valid files, so fuzzing starts from inputs that reach every reader's end.
#[test]
fn seeds_are_valid_files() {
    use ridgefill_io::checkpoint::Checkpoint;
    use ridgefill_io::config::ModelConfig;
    use ridgefill_io::gguf::GgufFile;
    use ridgefill_io::hf::SafetensorsSet;

    for (v, tied, extras) in [(3, false, false), (2, true, true)] {
        let file = GgufFile::from_bytes("seed.gguf", micro_gguf(v, tied, extras)).unwrap();
        for t in file.tensors() {
            file.dequantize(&t.name).unwrap();
        }
        let ckpt = Checkpoint::from_gguf(file).unwrap();
        for name in ckpt.tensor_names() {
            ckpt.tensor_f32(&name).unwrap();
        }
        let t = ckpt.chat_template.as_ref().unwrap();
        t.render(&[ridgefill_io::ChatMessage::new("user", "hi")], true)
            .unwrap();
    }
    let cfg = serde_json::to_string(&micro_config()).unwrap();
    ModelConfig::from_hf_json(Path::new("config.json"), &cfg).unwrap();
    let set = SafetensorsSet::from_bytes("m.safetensors".into(), micro_safetensors()).unwrap();
    for name in set.names() {
        set.to_f32(name).unwrap();
    }
    let tmp = tempfile::tempdir().unwrap();
    for dtype in [FillDtype::F32, FillDtype::F16] {
        FillFile::from_bytes(Path::new("f"), micro_fill(tmp.path(), dtype)).unwrap();
    }
    StatsFile::from_bytes(Path::new("s"), micro_stats(tmp.path())).unwrap();
}
