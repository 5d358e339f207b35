//! `ridgefill chat` end to end, on SmolLM2: piped turns, `/reset`, and a turn that reuses the
//! cached conversation, prefills only its new tokens and answers exactly as a fresh prefill of
//! the whole conversation does.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

/// Three turns, each building on the one before.
const TURNS: &str = "What is the capital of France?\nAnd of Italy?\nName a river there.\n";

/// A system prompt long enough that its reuse leaves the last rows it must run
/// (`Decoder::reuse_min_rows`) to run.
const SYSTEM: &str = "You are a geography tutor. Answer briefly and name the country. ";
const SYSTEM_REPEATS: usize = 8;

/// Greedy tokens per reply.
const REPLY_TOKENS: &str = "12";

/// `chat` on SmolLM2 with the tutor system prompt, greedy, `extra` flags, each turn's cache use
/// on stderr; stdin and stderr piped.
fn chat_command(extra: &[&str]) -> Command {
    let model = common::smollm2_ckpt().path.to_str().unwrap().to_owned();
    let mut cmd = Command::new(common::BIN);
    cmd.args(["chat", "-m", &model, "-n", REPLY_TOKENS, "--temp", "0"])
        .args(["--system", &SYSTEM.repeat(SYSTEM_REPEATS)])
        .args(extra)
        .env("RIDGEFILL_CHAT_VERBOSE", "1")
        .stdin(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Runs `chat` on [`TURNS`] with `extra` flags: (stdout, each turn's (prompt, reused) tokens).
fn chat(extra: &[&str]) -> (String, Vec<(usize, usize)>) {
    let mut child = chat_command(extra).stdout(Stdio::piped()).spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(TURNS.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    );
    assert!(out.status.success(), "chat failed: {stderr}");
    // "chat: prompt P tokens, R reused from the cache, N prefilled"
    let turns = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("chat: prompt "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[0].parse().unwrap(), w[2].parse().unwrap())
        })
        .collect();
    (stdout, turns)
}

#[test]
fn a_turn_prefills_only_its_new_tokens_and_answers_as_a_fresh_prefill() {
    let (reused, turns) = chat(&[]);
    let (fresh, fresh_turns) = chat(&["--no-cache-prompt"]);
    assert_eq!(reused, fresh, "replies with and without the cached prefix");
    assert_eq!(reused.lines().count(), 3, "{reused}");
    assert_eq!(turns.len(), 3, "{turns:?}");
    assert_eq!(turns[0].1, 0, "the first turn has nothing to reuse");
    for k in 1..3 {
        let ((before, _), (prompt, reuse)) = (turns[k - 1], turns[k]);
        // The earlier prompt renders the same, so all of it is reused, up to the last rows.
        let most = prompt - common::smollm2_reuse_min_rows();
        assert!(
            reuse >= before.min(most) && reuse <= most && reuse > 0,
            "turn {k}: {turns:?}"
        );
    }
    let prompts: Vec<usize> = turns.iter().map(|t| t.0).collect();
    assert_eq!(
        fresh_turns,
        prompts.iter().map(|&p| (p, 0)).collect::<Vec<_>>()
    );
}

/// `ridgefill chat` with piped turns: each reply streams on its own line, `/reset` forgets the
/// history (the same question then gets the same greedy answer), end of input leaves cleanly.
#[test]
fn chat_answers_piped_turns() {
    common::smollm2_ckpt();
    let mut child = Command::new(common::BIN)
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

/// With a fill file, every turn after the first is a skip-and-fill prefill over the cached
/// conversation (before, a filled cache could not be continued by a fill): it reuses the
/// earlier turns and replies.
#[test]
fn a_filled_conversation_is_continued_over_its_cache() {
    let dir = tempfile::tempdir().unwrap();
    let (_, fill) = common::serve::quick_fill(dir.path());
    let (replies, turns) = chat(&["--fill", fill.to_str().unwrap()]);
    assert_eq!(replies.lines().count(), 3, "{replies}");
    assert_eq!(turns.len(), 3, "{turns:?}");
    assert_eq!(turns[0].1, 0);
    assert!(
        turns[1..].iter().all(|&(_, reused)| reused > 0),
        "{turns:?}"
    );
}

/// While chat waits for the next message, the turn's filled rows settle (run exactly from their
/// stored split input): it says so once all of them have, and the next turn then restores no
/// rows; with `--no-settle` nothing settles and the next turn's spans restore rows instead.
#[test]
fn a_pause_between_turns_settles_the_filled_rows() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let (_, fill) = common::serve::quick_fill(dir.path());
    let fill = fill.to_str().unwrap();
    let run = |extra: &[&str]| -> Vec<String> {
        let mut child = chat_command(&[&["--fill", fill], extra].concat())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        let mut next = |seen: &mut Vec<String>| {
            let l = lines.next().expect("chat ended early").unwrap();
            seen.push(l.clone());
            l
        };
        writeln!(stdin, "What is the capital of France?").unwrap();
        // The first turn's report, then (settling) the line that says the cache is exact.
        while !next(&mut seen).starts_with("chat: prompt ") {}
        if extra.is_empty() {
            while !next(&mut seen).starts_with("chat: settled ") {}
        } else {
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        writeln!(stdin, "And of Italy?").unwrap();
        drop(stdin);
        while !next(&mut seen).starts_with("chat: prompt ") {}
        assert!(child.wait().unwrap().success(), "{seen:?}");
        seen
    };
    // "chat: prompt P tokens, R reused from the cache, N prefilled, F filled, S restored"
    let numbers = |l: &str| -> Vec<usize> {
        l.split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect()
    };
    let seen = run(&[]);
    let turns: Vec<Vec<usize>> = seen
        .iter()
        .filter(|l| l.starts_with("chat: prompt "))
        .map(|l| numbers(l))
        .collect();
    let settled = seen
        .iter()
        .find(|l| l.starts_with("chat: settled "))
        .unwrap();
    assert_eq!(
        numbers(settled)[0],
        turns[0][3],
        "settled every filled row: {seen:?}"
    );
    assert!(
        turns[1][1] > 0 && turns[1][4] == 0,
        "reused, restored nothing: {seen:?}"
    );

    // Restoring whatever share of attention the filled rows draw: the spans' mechanics.
    let seen = run(&["--no-settle", "--resume-min-attention", "0"]);
    assert!(
        !seen.iter().any(|l| l.starts_with("chat: settled ")),
        "{seen:?}"
    );
    let last = seen
        .iter()
        .rfind(|l| l.starts_with("chat: prompt "))
        .unwrap();
    assert!(
        numbers(last)[4] > 0,
        "unsettled rows restored by the spans: {seen:?}"
    );
}
