//! `ridgefill serve` reusing prompt prefixes across requests, on SmolLM2: a request sharing a
//! finished request's prefix prefills only the rest (`usage.prompt_tokens_details.cached_tokens`,
//! `/metrics`), and answers exactly as with `"cache_prompt": false`; a cache whose rows were
//! filled is never reused by a request that runs every layer, not even once an idle server has
//! settled its filled rows.

mod common;

use common::serve::{GREEDY_TOKENS, http, post, quick_fill, start};
use serde_json::{Value, json};

/// Prompt rows that run even when the whole prompt is cached.
fn min_rows() -> u64 {
    common::smollm2_reuse_min_rows() as u64
}

/// A shared system prompt long enough that reusing it matters (~250 tokens).
fn system() -> String {
    "You are a careful assistant for a library. Answer in one short sentence, name the shelf \
     and say nothing else. "
        .repeat(10)
}

/// A greedy chat request after [`system`], with `extra` fields.
fn ask(question: &str, extra: Value) -> Value {
    let mut body = json!({
        "messages": [
            {"role": "system", "content": system()},
            {"role": "user", "content": question},
        ],
        "max_tokens": GREEDY_TOKENS,
        "temperature": 0,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// (answer, prompt tokens, cached tokens) of one chat request.
fn chat(port: u16, body: &Value) -> (String, u64, u64) {
    let (status, r) = post(port, "/v1/chat/completions", body);
    assert_eq!(status, 200, "{r}");
    let u = &r["usage"];
    (
        r["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

/// The value of counter `name` in `/metrics`.
fn counter(port: u16, name: &str) -> u64 {
    let (_, _, text) = http(port, "GET", "/metrics", b"");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("ridgefill_{name} ")))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .parse()
        .unwrap()
}

#[test]
fn a_shared_prefix_is_prefilled_once_and_answers_as_afresh() {
    let server = start(&["--parallel", "2", "--ctx", "1024"]);
    let port = server.port;
    let (_, p1, c1) = chat(port, &ask("Where are the atlases?", json!({})));
    assert_eq!(c1, 0, "nothing cached yet");
    let (a2, p2, c2) = chat(port, &ask("Where are the cookbooks?", json!({})));
    // The system prompt and the template's opening are shared; the question is not.
    assert!(
        c2 > p1 / 2 && c2 < p2,
        "cached {c2} of {p2} (first prompt {p1})"
    );
    let (fresh, _, c3) = chat(
        port,
        &ask("Where are the cookbooks?", json!({"cache_prompt": false})),
    );
    assert_eq!((fresh.as_str(), c3), (a2.as_str(), 0));
    // The same prompt again: all of it but the last rows, which run as a cold prefill's do.
    let (a4, p4, c4) = chat(port, &ask("Where are the cookbooks?", json!({})));
    assert_eq!((a4.as_str(), c4), (a2.as_str(), p4 - min_rows()));
    // Anything but a boolean is refused, naming the field.
    let (status, r) = post(
        port,
        "/v1/chat/completions",
        &ask("Where are the maps?", json!({"cache_prompt": "yes"})),
    );
    assert_eq!(status, 400, "{r}");
    assert_eq!(r["error"]["param"], "cache_prompt", "{r}");
    let msg = r["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("`cache_prompt` must be true or false"),
        "{msg}"
    );
    let hits = counter(port, "prompt_cache_hit_tokens_total");
    let misses = counter(port, "prompt_cache_miss_tokens_total");
    assert_eq!(hits, c2 + c4);
    assert_eq!(hits + misses, p1 + p2 * 3);
}

#[test]
fn filled_rows_are_reused_only_by_filling_requests() {
    let dir = tempfile::tempdir().unwrap();
    let (_, fill) = quick_fill(dir.path());
    let server = start(&["--fill", fill.to_str().unwrap(), "--ctx", "1024"]);
    let port = server.port;
    let q = "Where are the atlases?";
    let (_, p, c) = chat(port, &ask(q, json!({})));
    assert_eq!(c, 0);
    // Exact rows wanted: the filled cache is passed over.
    let (exact, _, c) = chat(port, &ask(q, json!({"fill": false})));
    assert_eq!(c, 0, "a request without fill reused filled rows");
    let (again, _, c) = chat(port, &ask(q, json!({"fill": false})));
    assert_eq!(
        (again.as_str(), c),
        (exact.as_str(), p - min_rows()),
        "exact rows reused"
    );
    // A filling request may take either cache, and continues it with skip-and-fill.
    let (_, _, c) = chat(port, &ask(q, json!({})));
    assert_eq!(c, p - min_rows());
    let (status, v) = post(port, "/v1/chat/completions", &ask(q, json!({})));
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["fill_report"]["restored_rows"].is_u64(), "{v}");
}

/// An idle server settles a finished fill request's filled rows (`/metrics` counts them) that
/// its decode did not restore; the same conversation continued then reuses the cache and its
/// spans restore nothing, and a request without fill still does not reuse it. `--no-settle`
/// leaves the rows filled, and a decode past `--restore-every` tokens restores some of them.
#[test]
fn an_idle_server_settles_filled_rows() {
    let dir = tempfile::tempdir().unwrap();
    let (_, fill) = quick_fill(dir.path());
    let fill = fill.to_str().unwrap();
    let q = "Where are the atlases?";
    let filled_rows = |v: &Value| v["usage"]["fill_report"]["filled_rows"].as_u64().unwrap();
    let restored = |v: &Value| v["usage"]["fill_report"]["restored_rows"].as_u64().unwrap();
    let decode_restored = |v: &Value| {
        v["usage"]["fill_report"]["decode_restored_rows"]
            .as_u64()
            .unwrap()
    };
    let server = start(&["--fill", fill, "--ctx", "1024"]);
    let port = server.port;
    let (status, first) = post(port, "/v1/chat/completions", &ask(q, json!({})));
    assert_eq!(status, 200, "{first}");
    assert!(filled_rows(&first) > 0, "{first}");
    let to_settle = filled_rows(&first) - decode_restored(&first);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while counter(port, "settled_rows_total") < to_settle {
        assert!(
            std::time::Instant::now() < deadline,
            "settling never finished"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(counter(port, "settled_rows_total"), to_settle);
    let (status, again) = post(port, "/v1/chat/completions", &ask(q, json!({})));
    assert_eq!(status, 200, "{again}");
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0 && restored(&again) == 0, "{again}");
    let (_, _, c) = chat(port, &ask(q, json!({"fill": false})));
    assert_eq!(c, 0, "a request without fill reused a settled cache");
    drop(server);

    let server = start(&[
        "--fill",
        fill,
        "--ctx",
        "1024",
        "--no-settle",
        "--resume-min-attention",
        "0",
    ]);
    let port = server.port;
    let (status, _) = post(port, "/v1/chat/completions", &ask(q, json!({})));
    assert_eq!(status, 200);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(counter(port, "settled_rows_total"), 0);
    let (status, again) = post(port, "/v1/chat/completions", &ask(q, json!({})));
    assert_eq!(status, 200, "{again}");
    assert!(restored(&again) > 0, "{again}");
    let share = again["usage"]["fill_report"]["filled_attention"].as_f64();
    assert!(share.is_some_and(|s| s > 0.0 && s < 1.0), "{again}");
    // Twelve tokens, past the default `--restore-every 8`: a restore, which with
    // `--resume-min-attention 0` runs its spans among the rows still filled.
    let long = ask("Which shelf holds the maps?", json!({"ignore_eos": true}));
    let (status, v) = post(port, "/v1/chat/completions", &long);
    assert_eq!(status, 200, "{v}");
    assert!(decode_restored(&v) > 0, "{v}");
    assert!(counter(port, "decode_restores_total") >= 1);
}

/// One slot, two conversations taking turns: the host cache (`--cache-ram`) keeps the one the
/// slot churned out, so it is reused when it comes back; with `--cache-ram 0` only the slot's
/// own cache is kept and it is not. `/metrics` counts the kept caches and their bytes.
#[test]
fn the_host_cache_keeps_prefixes_through_slot_churn() {
    let other = |q: &str| {
        let mut b = ask(q, json!({}));
        b["messages"][0]["content"] = json!(system().replace("library", "museum"));
        b
    };
    for (ram, kept) in [("512", true), ("0", false)] {
        let server = start(&["--parallel", "1", "--cache-ram", ram]);
        let port = server.port;
        let (_, p, _) = chat(port, &ask("Where are the atlases?", json!({})));
        chat(port, &other("Where are the vases?"));
        let (_, _, c) = chat(port, &ask("Where are the atlases?", json!({})));
        // Without the host cache only the other conversation's shares a prefix: the template's.
        match kept {
            true => assert_eq!(c, p - min_rows(), "--cache-ram {ram}"),
            false => assert!(c < p / 4, "--cache-ram {ram}: {c} of {p} cached"),
        }
        let entries = counter(port, "prompt_cache_entries");
        assert_eq!(entries, if kept { 2 } else { 1 }, "--cache-ram {ram}");
        assert!(counter(port, "prompt_cache_bytes") > 0);
    }
}

/// A client that goes away while its prompt is prefilled leaves nothing half-written: the same
/// prompt asked again reuses either nothing (the cache was dropped) or the whole prompt (the
/// prefill had finished), and answers as a request that reuses nothing.
#[test]
fn a_client_gone_mid_prefill_leaves_no_half_written_cache() {
    use std::io::Write;
    let server = start(&["--parallel", "1"]);
    let port = server.port;
    let long = "The atlases are on the third floor, beside the map room. ".repeat(150);
    let body = ask(&long, json!({"stream": true}));
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Gone before its ~2000-token prompt can be prefilled.
    std::thread::sleep(std::time::Duration::from_millis(200));
    drop(s);
    let (again, p, c) = chat(port, &ask(&long, json!({})));
    assert!(c == 0 || c == p - min_rows(), "{c} of {p} tokens reused");
    let (fresh, _, c) = chat(port, &ask(&long, json!({"cache_prompt": false})));
    assert_eq!(c, 0);
    assert_eq!(again, fresh);
}
