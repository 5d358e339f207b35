//! Two `ridgefill serve` replicas behind HAProxy with `deploy/haproxy.cfg` (docs/deploy.md), on
//! loopback: the turns of one conversation reach one replica, so every later turn reuses its
//! cached prefix, where round-robin loses most of it; a replica killed in the middle of a reply
//! ends that reply at once (no hang), and the conversation's next turn is answered by the other.
//! Needs the `haproxy` binary (scripts/test.sh installs Debian's); without one the test says it
//! was skipped and why.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::serve::{Server, start};
use serde_json::{Value, json};

/// Turns of each conversation.
const TURNS: usize = 3;
/// How long HAProxy may take to listen, and to mark a killed replica down.
const READY: Duration = Duration::from_secs(20);
/// A reply cut by its replica's death must end within this (no hang).
const CUT_OFF: Duration = Duration::from_secs(15);

/// The `haproxy` binary, if one is installed.
fn haproxy() -> Option<PathBuf> {
    let dirs = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&dirs)
        .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
        .map(|d| d.join("haproxy"))
        .find(|p| p.is_file())
}

struct Proxy {
    child: Child,
    port: u16,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// HAProxy in front of `replicas` with the shipped config, balancing by `balance`.
fn proxy(bin: &Path, dir: &Path, replicas: &[&Server], balance: &str) -> Proxy {
    let port = free_port();
    let servers: Vec<String> = replicas
        .iter()
        .enumerate()
        .map(|(i, s)| format!("    server r{} 127.0.0.1:{}", i + 1, s.port))
        .collect();
    let cfg = std::fs::read_to_string(common::repo().join("deploy/haproxy.cfg"))
        .unwrap()
        .replace("@BIND@", &format!("127.0.0.1:{port}"))
        .replace("@BALANCE@", balance)
        .replace("@SERVERS@", &servers.join("\n"));
    let path = dir.join(format!("haproxy-{port}.cfg"));
    std::fs::write(&path, cfg).unwrap();
    let child = Command::new(bin)
        .arg("-db")
        .arg("-f")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start haproxy");
    let t0 = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < READY, "haproxy did not listen on {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Both replicas pass a health check before traffic counts.
    std::thread::sleep(Duration::from_secs(2));
    Proxy { child, port }
}

/// One chat request through the proxy: (status, the replica that answered, the JSON body).
fn chat(port: u16, body: &Value) -> (u16, String, Value) {
    let (status, head, text) = common::serve::http(
        port,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    let replica = head
        .lines()
        .find_map(|l| l.strip_prefix("x-replica: "))
        .unwrap_or("")
        .trim()
        .to_string();
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, replica, v)
}

/// Conversation `user`'s request after `turns` earlier question/answer pairs: each conversation
/// is about a document of its own.
fn turn(user: &str, earlier: &[(String, String)], question: &str) -> Value {
    let doc = format!("Notes of {user}. ")
        + &"The library keeps its atlases on the third floor, beside the map room. ".repeat(40);
    let mut messages = vec![json!({"role": "system", "content": doc})];
    for (q, a) in earlier {
        messages.push(json!({"role": "user", "content": q}));
        messages.push(json!({"role": "assistant", "content": a}));
    }
    messages.push(json!({"role": "user", "content": question}));
    json!({"user": user, "messages": messages, "max_tokens": 8, "temperature": 0})
}

/// Every conversation's turns through the proxy at `port`: (cached, prompt) tokens summed over
/// the turns after the first, and which replica answered each turn.
fn converse(port: u16, users: &[&str]) -> ((u64, u64), Vec<Vec<String>>) {
    let questions = ["Where are the atlases?", "Which floor?", "Beside what?"];
    let (mut cached, mut prompt) = (0, 0);
    let mut routes = vec![Vec::new(); users.len()];
    let mut history = vec![Vec::new(); users.len()];
    for (k, q) in questions.iter().enumerate().take(TURNS) {
        for (u, user) in users.iter().enumerate() {
            let (status, replica, v) = chat(port, &turn(user, &history[u], q));
            assert_eq!(status, 200, "{user}, turn {}: {v}", k + 1);
            let usage = &v["usage"];
            if k > 0 {
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap();
                prompt += usage["prompt_tokens"].as_u64().unwrap();
            }
            let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
            history[u].push((q.to_string(), answer.to_string()));
            routes[u].push(replica);
        }
    }
    ((cached, prompt), routes)
}

/// A streamed reply of `body` through the proxy, read until the stream ends: (replica, whether
/// it finished with `[DONE]`, how long after `kill` was called the read ended). `kill` runs once
/// the first event has arrived.
fn stream_and_kill(port: u16, body: &Value, kill: impl FnOnce(&str)) -> (String, bool, Duration) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(CUT_OFF * 2)).unwrap();
    let mut body = body.clone();
    body["stream"] = json!(true);
    let body = body.to_string();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut replica = String::new();
    let mut line = String::new();
    while r.read_line(&mut line).unwrap() > 0 && line != "\r\n" {
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("x-replica: ") {
            replica = v.trim().to_string();
        }
        line.clear();
    }
    line.clear();
    while r.read_line(&mut line).unwrap_or(0) > 0 && !line.contains("data: ") {
        line.clear();
    }
    let t0 = Instant::now();
    kill(&replica);
    let mut rest = String::new();
    let _ = r.read_to_string(&mut rest);
    (replica, rest.contains("[DONE]"), t0.elapsed())
}

#[test]
fn replicas_behind_haproxy_keep_conversations_and_route_around_a_dead_one() {
    let Some(bin) = haproxy() else {
        eprintln!(
            "skipped: no haproxy binary on PATH or in /usr/sbin (apt-get install haproxy; \
             scripts/test.sh installs it as root)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let args = ["--parallel", "1", "--ctx", "2048"];
    let mut replicas = vec![start(&args), start(&args)];
    // Three: an odd number, so round-robin does not keep a conversation on one replica by chance.
    let users = ["alice", "bob", "carol"];

    // Round-robin first, then affinity: each replica's cache then only holds what the
    // affinity run leaves, since every conversation's document differs.
    let rr = proxy(
        &bin,
        dir.path(),
        &[&replicas[0], &replicas[1]],
        "roundrobin",
    );
    let ((rr_cached, rr_prompt), _) = converse(rr.port, &users);
    drop(rr);
    let sticky = proxy(
        &bin,
        dir.path(),
        &[&replicas[0], &replicas[1]],
        "hash var(txn.conversation)",
    );
    let renamed: Vec<String> = users.iter().map(|u| format!("{u}-2")).collect();
    let renamed: Vec<&str> = renamed.iter().map(String::as_str).collect();
    let ((cached, prompt), routes) = converse(sticky.port, &renamed);
    let (hit, rr_hit) = (
        cached as f64 / prompt as f64,
        rr_cached as f64 / rr_prompt as f64,
    );
    eprintln!(
        "cached share of turns 2-{TURNS}: affinity {hit:.3}, round-robin {rr_hit:.3}; routes {routes:?}"
    );
    for (u, r) in renamed.iter().zip(&routes) {
        assert!(r.iter().all(|x| x == &r[0] && !x.is_empty()), "{u}: {r:?}");
    }
    assert!(
        hit > 0.8,
        "affinity reused {hit:.3} of later turns' prompts"
    );
    assert!(
        rr_hit < hit - 0.2,
        "round-robin {rr_hit:.3} vs affinity {hit:.3}"
    );

    // A long reply cut by its replica's death ends at once; the next turn goes to the other.
    let user = renamed[0];
    let mut long = turn(user, &[], "Describe the library at length.");
    long["max_tokens"] = json!(400);
    long["ignore_eos"] = json!(true);
    let (replica, done, took) = stream_and_kill(sticky.port, &long, |r| {
        let i: usize = r.trim_start_matches('r').parse::<usize>().unwrap() - 1;
        let _ = replicas[i].child.kill();
    });
    assert!(!done, "the reply from killed {replica} finished");
    assert!(took < CUT_OFF, "the cut reply took {took:?} to end");
    let t0 = Instant::now();
    let (status, other, v) = loop {
        let got = chat(sticky.port, &turn(user, &[], "Where are the atlases?"));
        if got.0 == 200 || t0.elapsed() > READY {
            break got;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status, 200, "after {replica} died: {v}");
    assert_ne!(other, replica, "{v}");
    replicas.clear();
}
