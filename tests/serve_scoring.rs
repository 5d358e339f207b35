//! `ridgefill serve` as lm-evaluation-harness uses it and as the fill reports itself, on the real
//! SmolLM2: `echo` + `logprobs` score a text as `ridgefill score` does, and bad scoring requests
//! get OpenAI's errors; `usage` reports what skip-and-fill filled, and a failed self-check falls
//! back to full prefill's answer; the tokenizer export gives HF tools the same ids.

mod common;

use common::serve::{GREEDY_TOKENS, chat_body, content, http, post, quick_fill, sse, start};
use serde_json::{Value, json};

/// Sum of `-token_logprobs` over a choice's entries `range` (every entry must be a number).
fn nll(choice: &Value, range: std::ops::Range<usize>) -> f64 {
    let lp = choice["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs in {choice}"));
    lp[range]
        .iter()
        .map(|v| {
            -v.as_f64()
                .unwrap_or_else(|| panic!("logprob {v} is not a number"))
        })
        .sum()
}

/// OpenAI's legacy `echo` + `logprobs`, the way lm-evaluation-harness scores a continuation: the
/// NLL of a text through the server equals `ridgefill score` on it (the same tokens: the
/// server's text prompt gets the same BOS handling), on a server with a fill file too (prompt
/// logprobs force full prefill); token-id prompts, batches, streamed logprobs; and the legacy
/// options' bad inputs get OpenAI's answers.
#[test]
fn serve_scores_prompts_with_echo_and_logprobs() {
    let ckpt = common::smollm2_ckpt();
    let dir = tempfile::tempdir().unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let model = s(&ckpt.path);
    let (corpus, fill) = quick_fill(dir.path());
    let fill_s = s(&fill);

    // Over two prefill chunks (256 rows), inside one `score` window.
    let text: String = corpus.chars().take(1800).collect();
    let text_file = dir.path().join("text.txt");
    std::fs::write(&text_file, &text).unwrap();
    let ids = ckpt.tokenizer.encode(&text, true).unwrap();
    assert!(ids.len() > 300 && ids.len() < 1000, "{} tokens", ids.len());
    let (ok, out, stderr) = common::ridgefill(&[
        "score",
        "-m",
        &model,
        "--device",
        "cpu",
        "--text",
        &s(&text_file),
        "--ctx",
        "1024",
        "--json",
    ]);
    assert!(ok, "score: {stderr}");
    let score: Value = serde_json::from_str(out.trim()).unwrap();
    let scored = score["tokens_scored"].as_u64().unwrap() as usize;
    let score_nll = score["mean_nll"].as_f64().unwrap() * scored as f64;
    assert_eq!(scored, ids.len() - 1);

    let server = start(&["--ctx", "1024", "--fill", &fill_s]);
    let port = server.port;

    // lm-eval's older loglikelihood request: echo, logprobs, no completion.
    let (status, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": text, "echo": true, "logprobs": 1, "max_tokens": 0, "temperature": 0}),
    );
    assert_eq!(status, 200, "{r}");
    let c = &r["choices"][0];
    assert_eq!(c["text"].as_str(), Some(text.as_str()));
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(r["usage"]["prompt_tokens"].as_u64(), Some(ids.len() as u64));
    assert_eq!(r["usage"]["completion_tokens"], 0);
    assert_eq!(
        r["usage"]["fill"], false,
        "prompt logprobs must run full prefill"
    );
    let lp = &c["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), ids.len());
    assert_eq!(tokens.concat(), text, "the tokens spell the echoed text");
    let mut at = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i].as_u64(), Some(at as u64), "token {i}");
        at += t.chars().count();
    }
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    let server_nll = nll(c, 1..ids.len());
    let rel = (server_nll - score_nll).abs() / score_nll;
    eprintln!(
        "NLL over {scored} tokens: server {server_nll:.6}, score {score_nll:.6} (relative {rel:.2e})"
    );
    assert!(rel < 1e-4, "server {server_nll} vs score {score_nll}");
    for top in lp["top_logprobs"].as_array().unwrap()[1..].iter() {
        let n = top.as_object().unwrap().len();
        assert!(
            (1..=2).contains(&n),
            "top_logprobs {top}: logprobs 1 gives 1 or 2 entries"
        );
    }

    // lm-eval 0.4.13's request: token ids in a batch of one, one generated token that its
    // parser drops; the prompt's entries are the same, and the greedy token is its top-1.
    let (status, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": [ids], "echo": true, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}),
    );
    assert_eq!(status, 200, "{r}");
    let c2 = &r["choices"][0];
    let lp2 = c2["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(
        lp2.len(),
        ids.len() + 1,
        "prompt entries then the generated one"
    );
    assert_eq!(nll(c2, 1..ids.len()), server_nll);
    let last = lp2[ids.len()].as_f64().unwrap();
    let top = c2["logprobs"]["top_logprobs"][ids.len()]
        .as_object()
        .unwrap();
    let best = top
        .values()
        .filter_map(Value::as_f64)
        .fold(f64::MIN, f64::max);
    assert_eq!(last, best, "greedy token's logprob is its top-1 ({top:?})");
    assert!(c2["text"].as_str().unwrap().starts_with(&text));

    // Without logprobs (and not reusing the scored prompt's exact cache) the same prompt runs
    // skip-and-fill, and the server counts it.
    let (status, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": 1, "temperature": 0, "cache_prompt": false}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["fill"], true, "{r}");
    let (_, _, m) = http(port, "GET", "/metrics", b"");
    assert!(m.contains("ridgefill_filled_requests_total 1\n"), "{m}");

    // A batch: one choice per prompt, in order; a string prompt and a token-id prompt.
    let short = ckpt
        .tokenizer
        .encode("The capital of France is", true)
        .unwrap();
    let (status, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": ["The capital of France is", short], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{r}");
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[1]["index"], 1);
    assert_eq!(choices[0]["text"], choices[1]["text"], "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 8);

    // Generated-token logprobs, whole and streamed: one entry per token, spelling the text.
    let body = json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": true});
    let (status, r) = post(port, "/v1/completions", &body);
    assert_eq!(status, 200, "{r}");
    let c = &r["choices"][0];
    let whole = c["text"].as_str().unwrap().to_string();
    let toks: String = c["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(toks, whole);
    assert_eq!(c["logprobs"]["tokens"].as_array().unwrap().len(), 6);
    let mut b = body.clone();
    b["stream"] = json!(true);
    let (status, _, sse_body) = http(port, "POST", "/v1/completions", b.to_string().as_bytes());
    assert_eq!(status, 200);
    let (mut streamed, mut streamed_toks) = (String::new(), String::new());
    for e in sse(&sse_body).iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        streamed.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
        if let Some(t) = v["choices"][0]["logprobs"]["tokens"].as_array() {
            streamed_toks.extend(t.iter().map(|t| t.as_str().unwrap().to_string()));
        }
    }
    assert_eq!(
        (streamed.as_str(), streamed_toks.as_str()),
        (whole.as_str(), whole.as_str())
    );

    // `echo` alone: the prompt's text, then the completion; no logprobs.
    let (status, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "echo": true, "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        r["choices"][0]["text"].as_str(),
        Some(format!("The capital of France is{whole}").as_str())
    );
    assert!(r["choices"][0]["logprobs"].is_null(), "{r}");

    // `max_tokens: 0` without echo: OpenAI's schema allows it (minimum 0); an empty completion.
    let (status, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 0}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["text"], "");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 0);

    // Bad legacy options: OpenAI's 400 naming the field.
    let bad = [
        (
            "/v1/completions",
            json!({"prompt": "Hi", "echo": true, "stream": true, "max_tokens": 2}),
            "echo",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "logprobs": 21, "max_tokens": 2}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "logprobs": true, "max_tokens": 2}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "echo": "yes"}),
            "echo",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 1_000_000], "max_tokens": 2}),
            "token id",
        ),
        (
            "/v1/completions",
            json!({"prompt": [[1, 2], []], "max_tokens": 2}),
            "empty",
        ),
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"], "max_tokens": 2, "stream": true}),
            "one prompt",
        ),
        (
            "/v1/completions",
            json!({"prompt": {"text": "Hi"}}),
            "token ids",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": -1}),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat_body("hi", json!({"max_tokens": 0})),
            "max_tokens",
        ),
    ];
    for (path, body, needle) in bad {
        let (status, r) = post(port, path, &body);
        assert_eq!(status, 400, "{body}: {r}");
        let msg = r["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{body}: {msg:?} lacks {needle:?}");
        assert_eq!(r["error"]["type"], "invalid_request_error");
    }
}

/// The value of an unlabelled Prometheus sample `name` in `/metrics` text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// Per-request fill reports: on a fill server `usage.fill_report` says how many rows were filled,
/// the exact tail, the split and the self-check's error, in whole and streamed responses of both
/// endpoints, and `/metrics` adds up the filled rows. With `--max-fill-error` (or
/// `--max-span-error`) below any error the self-check falls back: nothing is filled, and the
/// greedy answer is full prefill's exactly; or, with `--retry-exact`, more rows run exactly.
#[test]
fn serve_reports_the_fill_and_falls_back_on_its_self_check() {
    let dir = tempfile::tempdir().unwrap();
    let (corpus, fill) = quick_fill(dir.path());
    let fill_s = fill.to_str().unwrap();
    // Several hundred tokens over two prefill chunks: a bulk well past sink and tail.
    let text: String = corpus.chars().take(1800).collect();
    let server = start(&["--ctx", "1024", "--fill", fill_s]);
    let strict = start(&[
        "--ctx",
        "1024",
        "--fill",
        fill_s,
        "--max-fill-error",
        "1e-9",
        "--retry-exact",
        "off",
    ]);
    let body = json!({"prompt": text, "max_tokens": GREEDY_TOKENS, "temperature": 0});
    // Cold, as the fallback is: a reused prefix would cut the prompt into other chunks, whose
    // f32 rounding may flip a near-tie in the greedy answer.
    let full_body = {
        let mut b = body.clone();
        b["fill"] = json!(false);
        b["cache_prompt"] = json!(false);
        b
    };

    let (status, r) = post(server.port, "/v1/completions", &body);
    assert_eq!(status, 200, "{r}");
    let (u, rep) = (&r["usage"], &r["usage"]["fill_report"]);
    assert_eq!(u["fill"], true, "{r}");
    let prompt_tokens = u["prompt_tokens"].as_u64().unwrap();
    let filled = rep["filled_rows"].as_u64().unwrap_or_else(|| panic!("{r}"));
    let tail = rep["exact_tail"].as_u64().unwrap();
    assert!(filled > 0 && filled + tail < prompt_tokens, "{r}");
    assert!(tail >= 16, "--tail 16 at least: {r}");
    assert_eq!(rep["split"], 15, "{r}");
    assert_eq!(rep["fell_back"], false, "{r}");
    let error = rep["self_check_error"]
        .as_f64()
        .unwrap_or_else(|| panic!("{r}"));
    assert!(error > 0.0 && error.is_finite(), "{r}");
    let span_error = rep["self_check_span_error"]
        .as_f64()
        .unwrap_or_else(|| panic!("{r}"));
    assert!(span_error > 0.0 && span_error.is_finite(), "{r}");
    let coverage = rep["span_coverage"]
        .as_f64()
        .unwrap_or_else(|| panic!("{r}"));
    assert!(coverage > 0.0 && coverage <= 1.0, "{r}");
    eprintln!("fill report of a {prompt_tokens}-token prompt: {rep}");

    // Streamed chat: the last chunk's usage carries the report.
    let chat = chat_body(&text, json!({"stream": true, "max_tokens": 4}));
    let (status, _, sse_body) = http(
        server.port,
        "POST",
        "/v1/chat/completions",
        chat.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{sse_body}");
    let usage: Vec<Value> = sse(&sse_body)
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| c.get("usage").cloned())
        .collect();
    assert_eq!(usage.len(), 1, "usage on the last chunk only: {sse_body}");
    let chat_filled = usage[0]["fill_report"]["filled_rows"].as_u64().unwrap();
    assert!(chat_filled > 0, "{}", usage[0]);
    assert_eq!(usage[0]["fill"], true);

    // `"fill": false` runs no fill and reports none; a prompt within the exact tail fills nothing.
    let (status, full) = post(server.port, "/v1/completions", &full_body);
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["usage"]["fill"], false, "{full}");
    assert!(full["usage"]["fill_report"].is_null(), "{full}");
    let (status, r) = post(
        server.port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(status, 200, "{r}");
    let rep = &r["usage"]["fill_report"];
    assert_eq!(r["usage"]["fill"], false, "{r}");
    assert_eq!(rep["filled_rows"], 0, "{r}");
    assert_eq!(rep["exact_tail"], r["usage"]["prompt_tokens"], "{r}");
    assert!(
        rep["split"].is_null() && rep["self_check_error"].is_null(),
        "{r}"
    );
    let (_, _, m) = http(server.port, "GET", "/metrics", b"");
    assert_eq!(
        metric(&m, "ridgefill_filled_rows_total"),
        (filled + chat_filled) as f64
    );
    assert_eq!(metric(&m, "ridgefill_filled_requests_total"), 2.0);
    assert_eq!(metric(&m, "ridgefill_fill_fallbacks_total"), 0.0);

    // The strict server: the same self-check error, over the limit, so every row runs every
    // layer: full prefill's greedy answer, token for token.
    let (status, r) = post(strict.port, "/v1/completions", &body);
    assert_eq!(status, 200, "{r}");
    let rep = &r["usage"]["fill_report"];
    assert_eq!(rep["fell_back"], true, "{r}");
    assert_eq!(rep["filled_rows"], 0, "{r}");
    assert!(rep["split"].is_null(), "{r}");
    assert_eq!(r["usage"]["fill"], false, "{r}");
    let strict_error = rep["self_check_error"].as_f64().unwrap();
    assert!(
        (strict_error - error).abs() <= 1e-4 * error,
        "{strict_error} vs {error}"
    );
    let answer = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(
        answer(&r),
        answer(&full),
        "fallback vs the fill server's full prefill"
    );
    let (_, strict_full) = post(strict.port, "/v1/completions", &full_body);
    assert_eq!(answer(&r), answer(&strict_full));
    // Chat falls back the same way.
    let chat = chat_body(&text, json!({}));
    let (status, r) = post(strict.port, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["fill_report"]["fell_back"], true, "{r}");
    let mut chat_full = chat.clone();
    chat_full["fill"] = json!(false);
    chat_full["cache_prompt"] = json!(false);
    let (_, r_full) = post(strict.port, "/v1/chat/completions", &chat_full);
    assert_eq!(content(&r), content(&r_full));
    let (_, _, m) = http(strict.port, "GET", "/metrics", b"");
    assert_eq!(metric(&m, "ridgefill_fill_fallbacks_total"), 2.0);
    assert_eq!(metric(&m, "ridgefill_filled_rows_total"), 0.0);
    assert_eq!(metric(&m, "ridgefill_filled_requests_total"), 0.0);
    drop(strict);

    // The second reading alone, over the spans, fails the same way: its error is the fill
    // server's, the first reading within its default limit. With `--retry-exact` the prompt is
    // then filled again with that share of its rows exact, not run exactly (the default
    // quarter adds no span to this short prompt's minimum, so it would run exactly).
    let spans_strict = start(&[
        "--ctx",
        "1024",
        "--fill",
        fill_s,
        "--max-span-error",
        "1e-9",
        "--retry-exact",
        "0.5",
    ]);
    let (status, r) = post(spans_strict.port, "/v1/completions", &body);
    assert_eq!(status, 200, "{r}");
    let rep = &r["usage"]["fill_report"];
    assert_eq!(
        (&rep["fell_back"], &rep["widened"]),
        (&json!(false), &json!(true)),
        "{r}"
    );
    let strict_span = rep["self_check_span_error"].as_f64().unwrap();
    assert!(
        (strict_span - span_error).abs() <= 1e-4 * span_error,
        "{strict_span} vs {span_error}"
    );
    let retried = rep["filled_rows"].as_u64().unwrap();
    assert!(
        retried > 0 && retried < filled,
        "{retried} of the fill's {filled} rows: {r}"
    );
    assert_eq!(r["usage"]["fill"], true, "{r}");
    let (_, _, m) = http(spans_strict.port, "GET", "/metrics", b"");
    assert_eq!(metric(&m, "ridgefill_fill_retries_total"), 1.0);
    assert_eq!(metric(&m, "ridgefill_fill_fallbacks_total"), 0.0);
}

/// `ridgefill info --export-tokenizer`: the tokenizer.json it writes, read back with the
/// `tokenizers` crate (what transformers' fast tokenizers run), gives RidgeFill's own ids; the
/// config names BOS, EOS and the chat template.
#[test]
fn info_exports_the_tokenizer_for_hugging_face_tools() {
    let ckpt = common::smollm2_ckpt();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tok");
    let (ok, stdout, stderr) = common::ridgefill(&[
        "info",
        "-m",
        ckpt.path.to_str().unwrap(),
        "--export-tokenizer",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("tokenizer.json"), "{stdout}");
    let hf = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let texts = [
        "The year 2024 had 366 days; π ≈ 3.14159.",
        "naïve café — 東京タワー 🚀 x² ½",
        "<|im_start|>user\nWhat is 12*34?<|im_end|>\n",
        "  leading spaces,\ttabs\n\nand 1234567890 digits",
    ];
    for text in texts {
        for special in [false, true] {
            let ours = ckpt.tokenizer.encode(text, special).unwrap();
            let theirs = hf.encode(text, special).unwrap().get_ids().to_vec();
            assert_eq!(ours, theirs, "{text:?} (special tokens {special})");
        }
        let ids = ckpt.tokenizer.encode(text, false).unwrap();
        assert_eq!(hf.decode(&ids, false).unwrap(), text);
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["bos_token"], "<|im_start|>");
    assert_eq!(config["eos_token"], "<|im_end|>");
    assert_eq!(config["clean_up_tokenization_spaces"], false);
    assert_eq!(
        config["chat_template"].as_str(),
        ckpt.chat_template.as_ref().map(|t| t.source())
    );
    let map: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("special_tokens_map.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(map["eos_token"], "<|im_end|>");

    // A SentencePiece vocabulary (Gemma 3) is refused, naming why; nothing is written.
    let gemma = common::gemma3_ckpt();
    let out = dir.path().join("gemma");
    let (ok, _, stderr) = common::ridgefill(&[
        "info",
        "-m",
        gemma.path.to_str().unwrap(),
        "--export-tokenizer",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("SentencePiece"), "{stderr}");
    assert!(!out.exists());
}
