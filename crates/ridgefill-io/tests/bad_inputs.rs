//! Corrupt or inconsistent inputs give typed errors naming the file and the field or tensor.

use std::path::{Path, PathBuf};

use ridgefill_io::IoError;
use ridgefill_io::checkpoint::Checkpoint;
use ridgefill_io::gguf::GgufFile;
use ridgefill_io::gguf::writer::GgufWriter;
use ridgefill_testkit::assert_names;
use ridgefill_testkit::tiny::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn tiny_gguf_bytes(faults: &Faults, path: &Path) -> Vec<u8> {
    gguf_writer(&tiny(), faults).to_bytes(path).unwrap()
}

fn open_err(path: &Path) -> IoError {
    Checkpoint::open(path).expect_err("opening must fail")
}

#[test]
fn truncated_gguf() {
    let dir = tmp();
    let path = dir.path().join("t.gguf");
    let bytes = tiny_gguf_bytes(&Faults::default(), &path);
    // Cut in the middle of the first tensor's name, after all metadata.
    let name = b"token_embd.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap();
    std::fs::write(&path, &bytes[..at + name.len() / 2]).unwrap();
    let err = open_err(&path);
    assert!(matches!(err, IoError::Truncated { .. }), "{err:?}");
    assert_names(&err, &path, &["truncated", "tensor info #0 name"]);

    // Cut right after the header: the declared metadata cannot fit.
    std::fs::write(&path, &bytes[..100]).unwrap();
    let err = open_err(&path);
    assert!(matches!(err, IoError::LengthExceedsFile { .. }), "{err:?}");
    assert_names(&err, &path, &["kv_count"]);
}

#[test]
fn wrong_magic() {
    let dir = tmp();
    let path = dir.path().join("m.gguf");
    let mut bytes = tiny_gguf_bytes(&Faults::default(), &path);
    bytes[..4].copy_from_slice(b"GGML");
    std::fs::write(&path, &bytes).unwrap();
    let err = open_err(&path);
    assert!(matches!(err, IoError::BadMagic { .. }), "{err:?}");
    assert_names(&err, &path, &["magic", "GGML"]);
}

#[test]
fn unsupported_version() {
    let dir = tmp();
    let path = dir.path().join("v.gguf");
    let mut w = gguf_writer(&tiny(), &Faults::default());
    w.version(1).write(&path).unwrap();
    let err = open_err(&path);
    assert!(
        matches!(err, IoError::UnsupportedVersion { found: 1, .. }),
        "{err:?}"
    );
    assert_names(&err, &path, &["version", "found 1"]);
}

#[test]
fn unknown_quant_type() {
    let dir = tmp();
    let path = dir.path().join("q.gguf");
    let mut w = gguf_writer(&tiny(), &Faults::default());
    w.add_tensor_raw_id("blk.0.mystery.weight", &[32], 99, vec![0; 32]);
    w.write(&path).unwrap();
    let err = open_err(&path);
    assert!(
        matches!(err, IoError::UnknownGgmlType { type_id: 99, .. }),
        "{err:?}"
    );
    assert_names(&err, &path, &["blk.0.mystery.weight", "99"]);
}

#[test]
fn known_but_unsupported_quant_type_fails_on_dequantise() {
    let dir = tmp();
    let path = dir.path().join("q2.gguf");
    let mut w = GgufWriter::new();
    w.add_tensor_raw(
        "x.weight",
        &[256],
        ridgefill_io::GgmlType::Q2_K,
        vec![0; 84],
    );
    w.write(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let err = f.dequantize("x.weight").unwrap_err();
    assert_names(&err, &path, &["x.weight", "Q2_K"]);
}

#[test]
fn missing_tensor_gguf() {
    let dir = tmp();
    let path = dir.path().join("missing.gguf");
    let faults = Faults {
        skip_tensor: Some("model.layers.1.mlp.down_proj.weight"),
        ..Faults::default()
    };
    write_gguf(&tiny(), &path, &faults);
    let err = open_err(&path);
    assert!(matches!(err, IoError::MissingTensor { .. }), "{err:?}");
    assert_names(
        &err,
        &path,
        &["model.layers.1.mlp.down_proj.weight", "not found"],
    );
}

#[test]
fn missing_tensor_hf_and_lookup() {
    let dir = tmp();
    let hf = dir.path().join("hf");
    let faults = Faults {
        skip_tensor: Some("model.layers.0.self_attn.v_proj.weight"),
        ..Faults::default()
    };
    write_hf_dir(&tiny(), &hf, &faults);
    let err = open_err(&hf);
    assert_names(
        &err,
        &hf.join("model.safetensors"),
        &["model.layers.0.self_attn.v_proj.weight"],
    );

    let ok = dir.path().join("ok");
    write_hf_dir(&tiny(), &ok, &Faults::default());
    let c = Checkpoint::open(&ok).unwrap();
    let err = c
        .tensor_f32("model.layers.9.self_attn.q_proj.weight")
        .unwrap_err();
    assert_names(
        &err,
        &ok.join("model.safetensors"),
        &["model.layers.9.self_attn.q_proj.weight", "not found"],
    );
}

#[test]
fn tensor_shape_contradicts_config() {
    let dir = tmp();
    let hf = dir.path().join("hf");
    let name = "model.layers.1.self_attn.q_proj.weight";
    let faults = Faults {
        short_tensor: Some(name),
        ..Faults::default()
    };
    write_hf_dir(&tiny(), &hf, &faults);
    let err = open_err(&hf);
    assert!(matches!(err, IoError::ShapeMismatch { .. }), "{err:?}");
    let expected = format!("{:?}", [HEADS * HEAD_DIM, HIDDEN]);
    let found = format!("{:?}", [HEADS * HEAD_DIM - 1, HIDDEN]);
    assert_names(
        &err,
        &hf.join("model.safetensors"),
        &[name, &expected, &found],
    );

    let gguf = dir.path().join("s.gguf");
    write_gguf(&tiny(), &gguf, &Faults::default());
    let mut w = gguf_writer(&tiny(), &Faults::default());
    w.add_meta("llama.feed_forward_length", (INTERMEDIATE + 32) as u32);
    w.write(&gguf).unwrap();
    let err = open_err(&gguf);
    assert_names(&err, &gguf, &["mlp.", "ffn_", "expected"]);
}

#[test]
fn missing_tokenizer_hf() {
    let dir = tmp();
    let hf = dir.path().join("hf");
    let faults = Faults {
        no_tokenizer: true,
        ..Faults::default()
    };
    write_hf_dir(&tiny(), &hf, &faults);
    let err = open_err(&hf);
    assert!(matches!(err, IoError::MissingFile { .. }), "{err:?}");
    assert_names(&err, &hf.join("tokenizer.json"), &["tokenizer"]);
}

#[test]
fn missing_tokenizer_gguf() {
    let dir = tmp();
    let path = dir.path().join("notok.gguf");
    let faults = Faults {
        no_tokenizer: true,
        ..Faults::default()
    };
    write_gguf(&tiny(), &path, &faults);
    let err = open_err(&path);
    assert!(matches!(err, IoError::MissingMetadata { .. }), "{err:?}");
    assert_names(&err, &path, &["tokenizer.ggml.tokens", "missing"]);
}

#[test]
fn unsupported_tokenizer_model() {
    let dir = tmp();
    let path = dir.path().join("unigram.gguf");
    let mut w = gguf_writer(&tiny(), &Faults::default());
    // T5's SentencePiece unigram model: not one RidgeFill rebuilds.
    w.add_meta("tokenizer.ggml.model", "t5");
    w.write(&path).unwrap();
    let err = open_err(&path);
    assert!(
        matches!(err, IoError::UnsupportedTokenizer { .. }),
        "{err:?}"
    );
    assert_names(
        &err,
        &path,
        &["tokenizer.ggml.model", "\"t5\"", "\"llama\""],
    );
}

#[test]
fn sentencepiece_tokenizer_needs_scores() {
    let dir = tmp();
    let path = dir.path().join("spm.gguf");
    let mut w = gguf_writer(&tiny(), &Faults::default());
    w.add_meta("tokenizer.ggml.model", "llama");
    w.write(&path).unwrap();
    let err = open_err(&path);
    assert_names(&err, &path, &["tokenizer.ggml.scores", "missing"]);
}

/// Byte offset of the `offset` field of tensor `name` inside a GGUF written by [`GgufWriter`].
fn tensor_offset_field(bytes: &[u8], name: &str, n_dims: usize) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .expect("tensor info present");
    at + needle.len() + 4 + 8 * n_dims + 4
}

#[test]
fn tensor_offset_past_end_of_file() {
    let dir = tmp();
    let path = dir.path().join("off.gguf");
    let mut bytes = tiny_gguf_bytes(&Faults::default(), &path);
    let field = tensor_offset_field(&bytes, "output_norm.weight", 1);
    let far = (bytes.len() as u64).div_ceil(32) * 32;
    bytes[field..field + 8].copy_from_slice(&far.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = open_err(&path);
    assert!(matches!(err, IoError::BadTensor { .. }), "{err:?}");
    assert_names(&err, &path, &["output_norm.weight", "data range"]);
}

fn push_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b
}

#[test]
fn huge_metadata_array_length_is_rejected_without_allocating() {
    let dir = tmp();
    let path: PathBuf = dir.path().join("huge.gguf");
    const ARRAY: u32 = 9;
    const STRING: u32 = 8;
    let mut b = header(0, 1);
    push_str(&mut b, "tokenizer.ggml.tokens");
    b.extend_from_slice(&ARRAY.to_le_bytes());
    b.extend_from_slice(&STRING.to_le_bytes());
    b.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
    b.extend_from_slice(&[0; 64]);
    std::fs::write(&path, &b).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, IoError::LengthExceedsFile { .. }), "{err:?}");
    assert_names(&err, &path, &["tokenizer.ggml.tokens", "array length"]);
}

#[test]
fn huge_counts_and_string_lengths_are_rejected() {
    let dir = tmp();
    let path = dir.path().join("counts.gguf");
    std::fs::write(&path, header(u64::MAX, 0)).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert_names(&err, &path, &["tensor_count"]);

    let mut b = header(0, 1);
    b.extend_from_slice(&(u64::MAX - 3).to_le_bytes());
    b.extend_from_slice(&[0; 32]);
    std::fs::write(&path, &b).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, IoError::Truncated { .. }), "{err:?}");
    assert_names(&err, &path, &["metadata entry #0 key"]);
}

#[test]
fn not_a_checkpoint_and_missing_path() {
    let dir = tmp();
    let txt = dir.path().join("notes.txt");
    std::fs::write(&txt, "hello").unwrap();
    let err = open_err(&txt);
    assert!(matches!(err, IoError::NotACheckpoint { .. }), "{err:?}");
    assert_names(&err, &txt, &["not a checkpoint"]);
    let empty_dir = dir.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    assert_names(&open_err(&empty_dir), &empty_dir, &["config.json"]);
    let nothing = dir.path().join("nothing.gguf");
    assert_names(&open_err(&nothing), &nothing, &["missing"]);
}

#[test]
fn bad_config_values() {
    let dir = tmp();
    let hf = dir.path().join("hf");
    write_hf_dir(&tiny(), &hf, &Faults::default());
    let mut cfg = config_json();
    cfg["num_key_value_heads"] = serde_json::json!(3);
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let err = open_err(&hf);
    assert!(matches!(err, IoError::Config { .. }), "{err:?}");
    assert_names(
        &err,
        &hf.join("config.json"),
        &["num_key_value_heads", "found 3"],
    );

    std::fs::write(hf.join("config.json"), r#"{"hidden_size": 64}"#).unwrap();
    let err = open_err(&hf);
    assert_names(&err, &hf.join("config.json"), &["intermediate_size"]);
}

#[test]
fn chat_template_errors_are_typed() {
    let t = ridgefill_io::ChatTemplate::new("{% if %}".into(), String::new(), String::new());
    let err = t.unwrap_err().to_string();
    assert!(err.contains("chat template failed to render"), "{err}");
    let t = ridgefill_io::ChatTemplate::new(
        "{{ raise_exception('only user/assistant roles') }}".into(),
        String::new(),
        String::new(),
    )
    .unwrap();
    let err = t.render(&[], false).unwrap_err().to_string();
    assert!(
        err.contains("chat template failed to render") && err.contains("only user/assistant roles"),
        "{err}"
    );
}

/// Writes the tiny GGUF with `edit` applied to its writer; returns the path.
fn tiny_gguf_with(dir: &Path, name: &str, edit: impl FnOnce(&mut GgufWriter)) -> PathBuf {
    let path = dir.join(name);
    let mut w = gguf_writer(&tiny(), &Faults::default());
    edit(&mut w);
    w.write(&path).unwrap();
    path
}

#[test]
fn overlapping_tensor_data_is_rejected() {
    let dir = tmp();
    let path = dir.path().join("overlap.gguf");
    let mut bytes = tiny_gguf_bytes(&Faults::default(), &path);
    // Point output_norm.weight at the first tensor's data (offset 0).
    let field = tensor_offset_field(&bytes, "output_norm.weight", 1);
    bytes[field..field + 8].copy_from_slice(&0u64.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, IoError::BadTensor { .. }), "{err:?}");
    assert_names(
        &err,
        &path,
        &[
            "data range",
            "to start at or after the end of tensor",
            "found data section offset",
        ],
    );
    // Same bytes from memory: same check, same message.
    let from_mem = GgufFile::from_bytes(&path, bytes).unwrap_err();
    assert_eq!(from_mem.to_string(), err.to_string());
}

#[test]
fn config_sizes_whose_products_overflow_are_rejected() {
    let dir = tmp();
    let hf = dir.path().join("hf");
    write_hf_dir(&tiny(), &hf, &Faults::default());
    let mut cfg = config_json();
    cfg["vocab_size"] = serde_json::json!(u64::MAX / 2);
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    let err = open_err(&hf);
    assert!(matches!(err, IoError::Config { .. }), "{err:?}");
    assert_names(
        &err,
        &hf.join("config.json"),
        &["vocab_size", "fits in usize", &(u64::MAX / 2).to_string()],
    );

    let mut cfg = config_json();
    cfg["head_dim"] = serde_json::json!(1u64 << 62);
    let path = hf.join("config.json");
    let err = ridgefill_io::ModelConfig::from_hf_json(&path, &cfg.to_string()).unwrap_err();
    assert_names(&err, &path, &["num_attention_heads", "head_dim"]);
}

#[test]
fn absurd_layer_count_finds_the_first_missing_layer_quickly() {
    let dir = tmp();
    let path = tiny_gguf_with(dir.path(), "layers.gguf", |w| {
        w.add_meta("llama.block_count", u32::MAX);
    });
    let started = std::time::Instant::now();
    let err = open_err(&path);
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert!(matches!(err, IoError::MissingTensor { .. }), "{err:?}");
    assert_names(
        &err,
        &path,
        &[
            &format!("model.layers.{LAYERS}.input_layernorm.weight"),
            "not found",
        ],
    );
}

#[test]
fn rope_freqs_with_absurd_head_dim_does_not_allocate_it() {
    let dir = tmp();
    let huge = 1u64 << 40;
    let path = tiny_gguf_with(dir.path(), "rope.gguf", |w| {
        w.add_meta("llama.attention.key_length", huge);
        w.add_tensor_f32(
            "rope_freqs.weight",
            &[(HEAD_DIM / 2) as u64],
            &[1.0; HEAD_DIM / 2],
        );
    });
    // Reaching the shape check at all means the 2^39 divisors were never built.
    let err = open_err(&path);
    assert!(matches!(err, IoError::ShapeMismatch { .. }), "{err:?}");
    assert_names(&err, &path, &["shape contradicts the config"]);
}

#[test]
fn safetensors_header_longer_than_file_is_rejected() {
    let dir = tmp();
    let hf = dir.path().join("hf");
    write_hf_dir(&tiny(), &hf, &Faults::default());
    let weights = hf.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    bytes[..8].copy_from_slice(&(50_000_000u64).to_le_bytes());
    std::fs::write(&weights, &bytes).unwrap();
    let err = open_err(&hf);
    assert!(matches!(err, IoError::Safetensors { .. }), "{err:?}");
    assert_names(
        &err,
        &weights,
        &[
            "invalid safetensors file",
            &format!("file is {} bytes", bytes.len()),
        ],
    );
}

#[test]
fn stats_and_fill_headers_longer_than_file_are_rejected() {
    let dir = tmp();
    let path = dir.path().join("x.stats");
    let mut b = (u64::MAX - 2).to_le_bytes().to_vec();
    b.extend_from_slice(b"{}");
    std::fs::write(&path, &b).unwrap();
    let err = ridgefill_io::StatsFile::read(&path).unwrap_err();
    assert!(matches!(err, IoError::Safetensors { .. }), "{err:?}");
    assert_names(
        &err,
        &path,
        &["invalid safetensors file", "file is 10 bytes"],
    );
    let err = ridgefill_io::FillFile::from_bytes(&path, b).unwrap_err();
    assert_names(
        &err,
        &path,
        &["invalid safetensors file", "file is 10 bytes"],
    );
}

#[test]
fn nan_weight_in_gguf_names_tensor_and_index() {
    let dir = tmp();
    let path = dir.path().join("nan.gguf");
    let mut t = tiny();
    let norm = t
        .tensors
        .iter_mut()
        .find(|x| x.hf_name == "model.norm.weight")
        .unwrap();
    norm.values[5] = f32::NAN;
    write_gguf(&t, &path, &Faults::default());
    // Opening reads no weight data; converting the tensor finds the NaN.
    let ckpt = Checkpoint::open(&path).unwrap();
    let err = ckpt.tensor_f32("model.norm.weight").unwrap_err();
    assert!(
        matches!(err, IoError::NonFinite { index: 5, .. }),
        "{err:?}"
    );
    assert_names(
        &err,
        &path,
        &[
            "model.norm.weight (GGUF output_norm.weight)",
            "element 5 is NaN",
            "expected a finite number",
        ],
    );
    // Other tensors still convert.
    ckpt.tensor_f32("model.layers.0.input_layernorm.weight")
        .unwrap();
}

#[test]
fn infinite_weight_in_safetensors_names_tensor_and_index() {
    let dir = tmp();
    let hf = dir.path().join("hf");
    let mut t = tiny();
    let norm = t
        .tensors
        .iter_mut()
        .find(|x| x.hf_name == "model.layers.1.input_layernorm.weight")
        .unwrap();
    norm.values[3] = f32::NEG_INFINITY;
    write_hf_dir(&t, &hf, &Faults::default());
    let ckpt = Checkpoint::open(&hf).unwrap();
    let err = ckpt
        .tensor_f32("model.layers.1.input_layernorm.weight")
        .unwrap_err();
    assert!(
        matches!(err, IoError::NonFinite { index: 3, .. }),
        "{err:?}"
    );
    assert_names(
        &err,
        &hf.join("model.safetensors"),
        &["model.layers.1.input_layernorm.weight", "element 3 is -inf"],
    );
}

#[test]
fn runaway_chat_templates_stop_with_typed_errors() {
    let new = |src: &str| {
        ridgefill_io::ChatTemplate::new(src.into(), String::new(), String::new()).unwrap()
    };
    // Endless work: 10^10 iterations run out of fuel.
    let t =
        new("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}");
    let err = t.render(&[], false).unwrap_err().to_string();
    assert!(
        err.contains("chat template failed to render") && err.contains("fuel"),
        "{err}"
    );
    // Unbounded recursion: a macro calling itself hits the recursion limit.
    let t = new("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
    let err = t.render(&[], false).unwrap_err().to_string();
    assert!(err.contains("recursion"), "{err}");
}

#[test]
fn namespaces_cannot_be_stored_in_namespaces() {
    let render = |src: &str| {
        ridgefill_io::ChatTemplate::new(src.into(), String::new(), String::new())
            .unwrap()
            .render(&[], false)
            .map_err(|e| e.to_string())
    };
    // Each of these made minijinja recurse until the stack overflowed (an abort).
    for src in [
        "{% set ns = namespace(x=1) %}{% set ns.me = ns %}{{ ns }}",
        "{% set ns = namespace(x=1) %}{% set ns.l = [1, {'k': ns}] %}{{ ns == ns }}",
        "{% set a = namespace() %}{% set b = namespace(a=a) %}{%- set a.b, c = b, 1 -%}{{ a|string }}",
        "{% set ns = namespace(x=1) %}{% set ns.s = [ns]|select %}{{ ns|dictsort }}",
    ] {
        let err = render(src).unwrap_err();
        assert!(
            err.contains("chat template failed to render")
                && err.contains("a namespace cannot be stored inside a namespace"),
            "{src}: {err}"
        );
    }
    // Ordinary namespace use is untouched, including strings that look like tags.
    let out = render(
        "{% set ns = namespace(n=0, s='') %}{% for i in range(3) %}{% set ns.n = ns.n + i %}\
         {%- set ns.s = ns.s ~ '%}' ~ \"{% set x.y = 1 %}\" -%}{% endfor %}{{ ns.n }} {{ ns.s|length }}\
         {% set ns.l = [1, [2, {'a': 3}]] %}{{ ns.l|tojson }}{% set ns.t %}block{% endset %}{{ ns.t }}",
    )
    .unwrap();
    assert_eq!(out, "3 57[1, [2, {\"a\": 3}]]block");
    // Deep values built by storing a value inside itself run out of the walk budget or depth.
    let err = render(
        "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}",
    )
    .unwrap_err();
    assert!(err.contains("nest at most"), "{err}");
}
