//! `ridgefill serve` end to end on 127.0.0.1 with the real SmolLM2: chat and text completions,
//! plain and streamed; every bad request gets its OpenAI-shaped 4xx and the server keeps
//! answering; concurrent greedy requests give the outputs they give alone; SIGTERM stops the
//! server cleanly (scoring and the fill report: `tests/serve_scoring.rs`). `RIDGEFILL_PYTHON`
//! must name an interpreter that has the `openai` package (`scripts/test.sh` sets one up),
//! through which `scripts/openai_client_check.py` talks to it.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::serve::{chat_body, content, http, post, sse, start};
use serde_json::{Value, json};

#[test]
fn serve_answers_openai_requests_batches_and_stops() {
    let server = start(&["--parallel", "4", "--ctx", "512", "--queue", "64"]);
    let port = server.port;

    // Plain chat completion.
    // A known path with the wrong method: 405 with the same JSON error shape, not an empty body.
    for (method, path, allow) in [
        ("GET", "/v1/chat/completions", "POST"),
        ("GET", "/v1/completions", "POST"),
        ("POST", "/health", "GET"),
    ] {
        let (status, head, text) = http(port, method, path, b"");
        assert_eq!(status, 405, "{method} {path}: {text}");
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("{method} {path}: not JSON: {text:?}"));
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("not allowed") && msg.contains(allow),
            "{msg:?}"
        );
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let allow_header = format!("allow: {}", allow.to_ascii_lowercase());
        assert!(head.contains(&allow_header), "{head}");
    }
    let (status, r) = post(
        port,
        "/v1/chat/completions",
        &chat_body("What is the capital of France?", json!({})),
    );
    assert_eq!(status, 200, "{r}");
    let answer = content(&r);
    assert!(answer.contains("Paris"), "{answer:?}");
    assert_eq!(r["object"], "chat.completion");
    let u = &r["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 5);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    assert!(u["ttft_ms"].as_f64().unwrap() >= u["prefill_ms"].as_f64().unwrap());

    // Streamed: the deltas add up to the plain answer, then [DONE].
    let body = chat_body("What is the capital of France?", json!({"stream": true}));
    let (status, head, text) = http(
        port,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200);
    assert!(head.contains("text/event-stream"), "{head}");
    let events = sse(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, answer);
    let last = chunks.last().unwrap();
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");

    // Text completion, and a stop string that cuts it.
    let (status, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{r}");
    let text = r["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.contains("Paris"), "{text:?}");
    let (_, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stop": "Paris"}),
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    assert_eq!(
        r["choices"][0]["text"].as_str().unwrap(),
        &text[..text.find("Paris").unwrap()]
    );
    let (_, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 3);

    // Bad requests: each gets its status and an OpenAI error object; the server keeps serving.
    let bad: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "/v1/chat/completions",
            b"{not json".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "/v1/chat/completions",
            b"[1, 2]".to_vec(),
            400,
            "JSON object",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string().into_bytes(),
            400,
            "empty",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string().into_bytes(),
            400,
            "array",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "hi"}]})
                .to_string()
                .into_bytes(),
            400,
            "wizard",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]})
                .to_string()
                .into_bytes(),
            400,
            "content",
        ),
        (
            "/v1/chat/completions",
            chat_body("hi", json!({"max_tokens": "ten"}))
                .to_string()
                .into_bytes(),
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat_body("hi", json!({"temperature": 7}))
                .to_string()
                .into_bytes(),
            400,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            chat_body("hi", json!({"stream": "yes"}))
                .to_string()
                .into_bytes(),
            400,
            "stream",
        ),
        (
            "/v1/chat/completions",
            chat_body(&"word ".repeat(600), json!({}))
                .to_string()
                .into_bytes(),
            400,
            "context",
        ),
        (
            "/v1/completions",
            json!({"prompt": ""}).to_string().into_bytes(),
            400,
            "empty",
        ),
        ("/v1/completions", vec![b' '; 5 << 20], 413, "limit"),
        ("/v1/nope", b"{}".to_vec(), 404, "unknown endpoint"),
    ];
    for (path, body, want, needle) in bad {
        let (status, _, text) = http(port, "POST", path, &body);
        assert_eq!(status, want, "{path}: {text}");
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path}: not JSON: {text}"));
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("{v}"));
        assert!(msg.contains(needle), "{path}: {msg:?} lacks {needle:?}");
        assert!(v["error"]["type"].is_string());
    }
    let (status, r) = post(
        port,
        "/v1/chat/completions",
        &chat_body("What is the capital of France?", json!({})),
    );
    assert_eq!((status, content(&r)), (200, answer.clone()));

    // Concurrency: 16 greedy requests from 8 clients equal the same requests run one by one.
    let prompts: Vec<String> = (0..16)
        .map(|i| format!("Write one sentence about the number {i}."))
        .collect();
    let alone: Vec<String> = prompts
        .iter()
        .take(4)
        .map(|p| content(&post(port, "/v1/chat/completions", &chat_body(p, json!({}))).1))
        .collect();
    let t0 = Instant::now();
    let together: Vec<(usize, String)> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..8)
            .map(|c| {
                let prompts = &prompts;
                s.spawn(move || {
                    (c..prompts.len())
                        .step_by(8)
                        .map(|i| {
                            let stream = i % 2 == 0;
                            let body = chat_body(&prompts[i], json!({"stream": stream}));
                            if stream {
                                let (st, _, text) = http(
                                    port,
                                    "POST",
                                    "/v1/chat/completions",
                                    body.to_string().as_bytes(),
                                );
                                assert_eq!(st, 200);
                                let out: String = sse(&text)
                                    .iter()
                                    .filter(|e| e.as_str() != "[DONE]")
                                    .filter_map(|e| {
                                        serde_json::from_str::<Value>(e).ok()?["choices"][0]
                                                    ["delta"]["content"]
                                                    .as_str()
                                                    .map(str::to_string)
                                    })
                                    .collect();
                                (i, out)
                            } else {
                                let (st, r) = post(port, "/v1/chat/completions", &body);
                                assert_eq!(st, 200, "{r}");
                                (i, content(&r))
                            }
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        jobs.into_iter().flat_map(|j| j.join().unwrap()).collect()
    });
    eprintln!(
        "16 requests from 8 clients in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(together.len(), prompts.len());
    for (i, out) in &together {
        assert!(!out.is_empty(), "request {i} came back empty");
        if *i < alone.len() {
            assert_eq!(
                out, &alone[*i],
                "request {i}: batched output differs from alone"
            );
        }
    }
    let (_, _, m) = http(port, "GET", "/metrics", b"");
    assert!(m.contains("ridgefill_requests_total"), "{m}");
    assert!(m.contains("ridgefill_ttft_seconds_bucket"), "{m}");
    // Prefill is part of each request's time to first token, never more.
    let value = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {m}"))
    };
    let (prefill, ttft) = (
        value("ridgefill_prefill_seconds_total"),
        value("ridgefill_ttft_seconds_sum"),
    );
    assert!(
        prefill > 0.0 && prefill <= ttft,
        "prefill {prefill} s, ttft {ttft} s"
    );
    let (status, _, models) = http(port, "GET", "/v1/models", b"");
    assert_eq!(status, 200);
    assert!(models.contains("\"object\":\"list\""), "{models}");

    // The official client (scripts/test.sh provides an interpreter with it).
    {
        let py = std::env::var_os("RIDGEFILL_PYTHON").expect(
            "RIDGEFILL_PYTHON must name a Python with the openai package (scripts/test.sh sets it up)",
        );
        let out = Command::new(py)
            .arg(common::repo().join("scripts/openai_client_check.py"))
            .arg(format!("http://127.0.0.1:{port}/v1"))
            .output()
            .expect("run scripts/openai_client_check.py");
        assert!(
            out.status.success(),
            "openai client check failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // SIGTERM: stops accepting and exits cleanly, promptly.
    let mut server = server;
    #[cfg(unix)]
    {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        loop {
            if let Some(status) = server.child.try_wait().unwrap() {
                assert!(status.success(), "exit status {status}");
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "still running 10 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Bad flags of `serve` and `chat` fail with a message naming the problem.
#[test]
fn serve_and_chat_refuse_bad_flags() {
    common::smollm2_ckpt();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_ridgefill"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let cases: [(&[&str], &str); 11] = [
        (
            &["serve", "--host", "no such host", "--port", "0"],
            "not an address",
        ),
        (&["serve", "--parallel", "0"], "--parallel"),
        (
            &[
                "serve",
                "--device",
                "cpu",
                "--port",
                "0",
                "--fill",
                "/nonexistent/x.fill",
            ],
            "/nonexistent/x.fill",
        ),
        (
            &["chat", "--device", "cpu", "-c", "64", "-n", "64"],
            "leaves no room",
        ),
        (&["chat", "--device", "cpu", "--temp", "hot"], "--temp"),
        (
            &["chat", "--device", "cpu", "--sentence-reach", "far"],
            "--sentence-reach",
        ),
        (
            &["serve", "--no-cache-prompt=yes", "--port", "0"],
            "--no-cache-prompt",
        ),
        (
            &["generate", "-p", "x", "--max-fill-error", "never"],
            "a positive number or off",
        ),
        (
            &["serve", "--cache-ram", "lots", "--port", "0"],
            "--cache-ram",
        ),
        (
            &["generate", "-p", "x", "--restore-every", "many"],
            "--restore-every",
        ),
        (
            &["chat", "--device", "cpu", "--restore-spans", "some"],
            "--restore-spans",
        ),
    ];
    for (args, needle) in cases {
        let (ok, stderr) = run(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}
