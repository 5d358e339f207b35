//! `ridgefill serve` end to end on 127.0.0.1 with the real SmolLM2: chat and text completions,
//! plain and streamed; every bad request gets its OpenAI-shaped 4xx and the server keeps
//! answering; concurrent greedy requests give the outputs they give alone; SIGTERM stops the
//! server cleanly; `echo` + `logprobs` score a text as `ridgefill score` does; `usage` reports
//! what skip-and-fill filled, and a failed self-check falls back to full prefill's answer; the
//! tokenizer export gives HF tools the same ids. `RIDGEFILL_PYTHON` must name an interpreter
//! that has the `openai` package (`scripts/test.sh` sets one up), through which
//! `scripts/openai_client_check.py` talks to it.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// How long the server may take to load and start listening.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Completion length of the comparison requests.
const GREEDY_TOKENS: u64 = 12;

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(extra: &[&str]) -> Server {
    common::smollm2_ckpt();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ridgefill"))
        .args(["serve", "--device", "cpu", "--port", "0"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ridgefill serve");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(p) = line.split("listening on http://127.0.0.1:").nth(1) {
                let _ = tx.send(p.trim().parse::<u16>().expect("port"));
            }
            eprintln!("server: {line}");
        }
    });
    let port = rx
        .recv_timeout(START_TIMEOUT)
        .expect("the server printed its address");
    Server { child, port }
}

/// One HTTP/1.1 exchange (connection closed after): status, lower-cased headers and the body,
/// de-chunked.
fn http(port: u16, method: &str, path: &str, body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    // A server refusing an oversized body may answer and close before reading all of it.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let read = s.read_to_end(&mut raw);
    assert!(read.is_ok() || !raw.is_empty(), "{method} {path}: {read:?}");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response head");
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let head = head.to_ascii_lowercase();
    let body = if head.contains("transfer-encoding: chunked") {
        let mut out = String::new();
        let mut rest = rest;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    (status, head, body)
}

fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, text) = http(port, "POST", path, body.to_string().as_bytes());
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The `data:` payloads of an SSE body.
fn sse(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

fn chat_body(content: &str, extra: Value) -> Value {
    // SmolLM2-135M answers plainly only with a system message.
    let mut b = json!({"model": "x", "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": content}],
        "max_tokens": GREEDY_TOKENS, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content in {v}"))
        .to_string()
}

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

/// `ridgefill chat` with piped turns: each reply streams on its own line, `/reset` forgets the
/// history (the same question then gets the same greedy answer), end of input leaves cleanly.
#[test]
fn chat_answers_piped_turns() {
    common::smollm2_ckpt();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ridgefill"))
        .args(["chat", "--device", "cpu", "--temp", "0", "-n", "12"])
        .args(["--system", "You are a helpful assistant."])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ridgefill chat");
    let q = "What is the capital of France?";
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{q}\n\n/reset\n{q}\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let replies: Vec<&str> = stdout.lines().collect();
    assert_eq!(replies.len(), 2, "{stdout:?}");
    assert!(replies[0].contains("Paris"), "{stdout:?}");
    assert_eq!(replies[0], replies[1]);
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
    let cases: [(&[&str], &str); 5] = [
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
    ];
    for (args, needle) in cases {
        let (ok, stderr) = run(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

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

/// A quick fit (as the CLI tests' fill files) at the shipped split 15, calibrated on
/// `tests/data/score.txt`, into `dir`: (the corpus, the fill file).
fn quick_fill(dir: &std::path::Path) -> (String, std::path::PathBuf) {
    let ckpt = common::smollm2_ckpt();
    let (fill, calib) = (dir.join("s15.fill"), dir.join("calib"));
    std::fs::create_dir(&calib).unwrap();
    let corpus = std::fs::read_to_string(common::repo().join("tests/data/score.txt")).unwrap();
    std::fs::write(calib.join("score.txt"), &corpus).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (model, calib_s, fill_s) = (s(&ckpt.path), s(&calib), s(&fill));
    let fit = [
        "fit", "-m", &model, "--device", "cpu", "--calib", &calib_s, "--split", "15", "--ctx",
        "256", "--alpha", "1e-3", "-o", &fill_s,
    ];
    let (ok, _, stderr) = common::ridgefill(&fit);
    assert!(ok, "fit: {stderr}");
    (corpus, fill)
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

    // Without logprobs the same prompt runs skip-and-fill, and the server counts it.
    let (status, r) = post(
        port,
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": 1, "temperature": 0}),
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
/// endpoints, and `/metrics` adds up the filled rows. With `--max-fill-error` below any error the
/// self-check falls back: nothing is filled, and the greedy answer is full prefill's exactly.
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
    ]);
    let body = json!({"prompt": text, "max_tokens": GREEDY_TOKENS, "temperature": 0});
    let full_body = {
        let mut b = body.clone();
        b["fill"] = json!(false);
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
    let (_, r_full) = post(strict.port, "/v1/chat/completions", &chat_full);
    assert_eq!(content(&r), content(&r_full));
    let (_, _, m) = http(strict.port, "GET", "/metrics", b"");
    assert_eq!(metric(&m, "ridgefill_fill_fallbacks_total"), 2.0);
    assert_eq!(metric(&m, "ridgefill_filled_rows_total"), 0.0);
    assert_eq!(metric(&m, "ridgefill_filled_requests_total"), 0.0);
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
