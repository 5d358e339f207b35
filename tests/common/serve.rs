//! `ridgefill serve` from a test: start a server on a free port, talk HTTP/1.1 to it, read its
//! JSON and SSE answers; a quick fill file to serve with. Shared by the `tests/serve*.rs` files.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

/// How long the server may take to load and start listening.
pub const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Completion length of the comparison requests.
pub const GREEDY_TOKENS: u64 = 12;

pub struct Server {
    pub child: Child,
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start(extra: &[&str]) -> Server {
    super::smollm2_ckpt();
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
pub fn http(port: u16, method: &str, path: &str, body: &[u8]) -> (u16, String, String) {
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

pub fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, text) = http(port, "POST", path, body.to_string().as_bytes());
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The `data:` payloads of an SSE body.
pub fn sse(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

pub fn chat_body(content: &str, extra: Value) -> Value {
    // SmolLM2-135M answers plainly only with a system message.
    let mut b = json!({"model": "x", "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": content}],
        "max_tokens": GREEDY_TOKENS, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

pub fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content in {v}"))
        .to_string()
}

/// A quick fit (as the CLI tests' fill files) at the shipped split 15, calibrated on
/// `tests/data/score.txt`, into `dir`: (the corpus, the fill file).
pub fn quick_fill(dir: &std::path::Path) -> (String, std::path::PathBuf) {
    let ckpt = super::smollm2_ckpt();
    let (fill, calib) = (dir.join("s15.fill"), dir.join("calib"));
    std::fs::create_dir(&calib).unwrap();
    let corpus = std::fs::read_to_string(super::repo().join("tests/data/score.txt")).unwrap();
    std::fs::write(calib.join("score.txt"), &corpus).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (model, calib_s, fill_s) = (s(&ckpt.path), s(&calib), s(&fill));
    let fit = [
        "fit", "-m", &model, "--device", "cpu", "--calib", &calib_s, "--split", "15", "--ctx",
        "256", "--alpha", "1e-3", "-o", &fill_s,
    ];
    let (ok, _, stderr) = super::ridgefill(&fit);
    assert!(ok, "fit: {stderr}");
    (corpus, fill)
}
