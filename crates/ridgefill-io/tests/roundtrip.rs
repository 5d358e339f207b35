//! The same tiny Llama as GGUF and as a HF directory must load identically.

use ridgefill_io::chat::ChatMessage;
use ridgefill_io::checkpoint::{Checkpoint, CheckpointFormat};
use ridgefill_io::config::{RopeScaling, llama3_rope_divisors};
use ridgefill_io::gguf::{GgufFile, MetaArray, MetaValue};
use ridgefill_testkit::tiny::*;

fn both() -> (tempfile::TempDir, Checkpoint, Checkpoint) {
    let t = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny.gguf");
    let hf = tmp.path().join("hf");
    write_gguf(&t, &gguf, &Faults::default());
    write_hf_dir(&t, &hf, &Faults::default());
    let g = Checkpoint::open(&gguf).unwrap_or_else(|e| panic!("{e}"));
    let h = Checkpoint::open(&hf).unwrap_or_else(|e| panic!("{e}"));
    (tmp, g, h)
}

#[test]
fn gguf_and_hf_give_identical_tensors() {
    let t = tiny();
    let (_tmp, g, h) = both();
    assert_eq!(g.format, CheckpointFormat::Gguf);
    assert_eq!(h.format, CheckpointFormat::HfSafetensors);
    assert_eq!(g.tensor_names(), h.tensor_names());
    assert_eq!(g.tensor_names().len(), t.tensors.len());
    for tt in &t.tensors {
        let gi = g.tensor_info(&tt.hf_name).unwrap();
        let hi = h.tensor_info(&tt.hf_name).unwrap();
        assert_eq!(gi.shape, tt.hf_shape, "{}", tt.hf_name);
        assert_eq!(hi.shape, tt.hf_shape, "{}", tt.hf_name);
        let gv = g.tensor_f32(&tt.hf_name).unwrap();
        let hv = h.tensor_f32(&tt.hf_name).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&gv), bits(&tt.values), "GGUF {}", tt.hf_name);
        assert_eq!(bits(&hv), bits(&tt.values), "HF {}", tt.hf_name);
    }
    assert_eq!(
        g.tensor_info("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .dtype,
        "Q8_0"
    );
    assert_eq!(
        h.tensor_info("model.layers.0.input_layernorm.weight")
            .unwrap()
            .dtype,
        "BF16"
    );
    assert!(g.has_tensor("lm_head.weight") && h.has_tensor("lm_head.weight"));
    assert!(!g.has_tensor("nope"));
    assert_ne!(g.weights_fingerprint(), h.weights_fingerprint());
}

#[test]
fn configs_match() {
    let (_tmp, g, h) = both();
    assert_eq!(g.config, h.config);
    assert_eq!(g.config.head_dim(), HEAD_DIM);
    assert_eq!(g.config.kv_dim(), KV_HEADS * HEAD_DIM);
    assert_eq!(g.config.rms_norm_eps, 1e-5);
    assert!(!g.config.tie_word_embeddings);
}

#[test]
fn tokenizers_match() {
    let (_tmp, g, h) = both();
    for text in [
        "hello the world",
        "<|im_start|>user\nthe 2024 hell<|im_end|>",
        "  spaces  and\ttabs\n\n",
        "naïve café 😀 12345",
        "",
    ] {
        let a = g.tokenizer.encode(text, true).unwrap();
        let b = h.tokenizer.encode(text, true).unwrap();
        assert_eq!(a, b, "{text:?}");
        assert_eq!(
            g.tokenizer.encode(text, false).unwrap(),
            a,
            "no BOS is configured"
        );
        assert_eq!(g.tokenizer.decode(&a, false).unwrap(), text);
        assert_eq!(h.tokenizer.decode(&b, false).unwrap(), text);
    }
    let ids = g
        .tokenizer
        .encode("<|im_start|>the<|im_end|>", false)
        .unwrap();
    assert_eq!(
        ids.first(),
        Some(&BOS_ID),
        "control tokens are matched as single tokens"
    );
    assert_eq!(g.tokenizer.decode(&ids, true).unwrap(), "the");
    for tok in [&g.tokenizer, &h.tokenizer] {
        assert_eq!(tok.bos_id(), Some(BOS_ID));
        assert!(tok.eos_ids().contains(&EOS_ID), "{:?}", tok.eos_ids());
        assert_eq!(tok.vocab_size(), tiny_vocab());
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(EOS_ID));
        assert_eq!(tok.id_to_token(BOS_ID).as_deref(), Some("<|im_start|>"));
    }
}

#[test]
fn stream_decoder_waits_for_whole_characters() {
    let (_tmp, g, _h) = both();
    let text = "a😀b";
    let ids = g.tokenizer.encode(text, false).unwrap();
    let mut stream = g.tokenizer.stream_decoder(false);
    let pieces: Vec<Option<String>> = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
    // The emoji is four byte tokens: three pushes yield nothing, the fourth the whole char.
    assert!(pieces.iter().any(Option::is_none), "{pieces:?}");
    let joined: String = pieces.into_iter().flatten().collect();
    assert_eq!(joined, text);
}

#[test]
fn chat_templates_match() {
    let (_tmp, g, h) = both();
    let msgs = [
        ChatMessage::new("user", "hi"),
        ChatMessage::new("assistant", "hello"),
    ];
    let a = g
        .chat_template
        .as_ref()
        .unwrap()
        .render(&msgs, true)
        .unwrap();
    let b = h
        .chat_template
        .as_ref()
        .unwrap()
        .render(&msgs, true)
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(
        a,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn gguf_metadata_round_trips_all_value_types() {
    let t = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    let mut w = gguf_writer(&t, &Faults::default());
    w.add_meta("general.alignment", 64u32)
        .add_meta("v.u8", 1u8)
        .add_meta("v.i8", -1i8)
        .add_meta("v.u16", 2u16)
        .add_meta("v.i16", -2i16)
        .add_meta("v.u64", u64::MAX)
        .add_meta("v.bool", true)
        .add_meta("v.f32s", vec![1.5f32, -2.0])
        .add_meta("v.bools", vec![true, false]);
    w.write(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert!(f.tensors().iter().all(|t| t.offset % 64 == 0));
    assert_eq!(f.get("v.u8"), Some(&MetaValue::U8(1)));
    assert_eq!(f.get("v.i8"), Some(&MetaValue::I8(-1)));
    assert_eq!(f.get_u32("v.u16").unwrap(), 2);
    assert_eq!(f.get_i64("v.i16").unwrap(), -2);
    assert_eq!(f.get_u64("v.u64").unwrap(), u64::MAX);
    assert!(f.get_bool("v.bool").unwrap());
    assert_eq!(f.get_float_array("v.f32s").unwrap(), vec![1.5, -2.0]);
    assert_eq!(f.get_i64("test.i64").unwrap(), -5);
    assert_eq!(f.get_f64("test.f64").unwrap(), 0.25);
    assert_eq!(
        f.get("test.nested"),
        Some(&MetaValue::Array(MetaArray::Array(vec![
            MetaArray::U8(vec![1, 2]),
            MetaArray::U8(vec![])
        ])))
    );
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        tiny_vocab()
    );
    // Typed getters name the key on a type mismatch or absence.
    let err = f.get_str("v.u8").unwrap_err().to_string();
    assert!(
        err.contains("v.u8") && err.contains("string") && err.contains(&path.display().to_string()),
        "{err}"
    );
    let err = f.get_u32("v.u64").unwrap_err().to_string();
    assert!(err.contains("v.u64"), "{err}");
    let err = f.get_u32("no.such.key").unwrap_err().to_string();
    assert!(
        err.contains("no.such.key") && err.contains("missing"),
        "{err}"
    );
    // Storage-order dequantisation of the permuted Q is the permuted HF matrix.
    let q = &t
        .tensors
        .iter()
        .find(|x| x.gguf_name == "blk.0.attn_q.weight")
        .unwrap();
    let stored = f.dequantize("blk.0.attn_q.weight").unwrap();
    assert_eq!(stored, llama_cpp_permute(&q.values, q.hf_shape[0], HEADS));
}

#[test]
fn rope_freqs_map_to_gguf_namespace_and_llama3_scaling() {
    let t = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("r.gguf");
    let scaling = RopeScaling {
        rope_type: Some("llama3".into()),
        factor: Some(8.0),
        low_freq_factor: Some(1.0),
        high_freq_factor: Some(4.0),
        original_max_position_embeddings: Some(8192),
        legacy_type: None,
    };
    // A large theta puts some pairs in each of the three llama3 regimes.
    let theta = 500_000.0f32;
    let freqs: Vec<f32> = llama3_rope_divisors(&scaling, f64::from(theta), HEAD_DIM)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let mut w = gguf_writer(&t, &Faults::default());
    w.add_meta("llama.rope.freq_base", theta);
    w.add_tensor_f32("rope_freqs.weight", &[(HEAD_DIM / 2) as u64], &freqs);
    w.write(&path).unwrap();
    let c = Checkpoint::open(&path).unwrap();
    assert!(c.has_tensor("gguf.rope_freqs.weight"));
    assert_eq!(c.tensor_f32("gguf.rope_freqs.weight").unwrap(), freqs);
    assert_eq!(c.config.rope_scaling.as_ref(), Some(&scaling));
}

#[test]
fn sharded_hf_directory_matches_single_file() {
    let t = tiny();
    let tmp = tempfile::tempdir().unwrap();
    let single = tmp.path().join("single");
    let sharded = tmp.path().join("sharded");
    write_hf_dir(&t, &single, &Faults::default());
    write_hf_dir(
        &t,
        &sharded,
        &Faults {
            sharded: true,
            ..Faults::default()
        },
    );
    let a = Checkpoint::open(&single).unwrap();
    let b = Checkpoint::open(&sharded).unwrap_or_else(|e| panic!("{e}"));
    assert!(sharded.join("model.safetensors.index.json").is_file());
    assert_eq!(a.tensor_names(), b.tensor_names());
    for name in a.tensor_names() {
        assert_eq!(
            a.tensor_f32(&name).unwrap(),
            b.tensor_f32(&name).unwrap(),
            "{name}"
        );
    }
    assert_eq!(a.weights_fingerprint(), b.weights_fingerprint());
    let err = b
        .tensor_f32("model.layers.7.mlp.up_proj.weight")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.safetensors.index.json")
            && err.contains("model.layers.7.mlp.up_proj.weight"),
        "{err}"
    );
}
