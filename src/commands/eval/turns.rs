//! `ridgefill eval --task passkey-turns`: retrieval across chat turns. A secret code is planted
//! in a document the user pastes in the first turn; an unrelated passage and its question fill
//! the second; the third asks for the code. Each method answers twice: prefilling the whole
//! conversation cold, and turn by turn over the cache the earlier turns left (prefix reuse, as
//! `chat` and `serve` do), the assistant's replies appended exactly as decoding appends them.
//! Under skip-and-fill with reuse the code's rows were filled in turn 1, when nothing asked for
//! them, so the last turn must find and re-run them ([`Prefill::resume`]); `fill+reuse+settle`
//! settles them between turns ([`settle`], as an idle `serve` or a waiting `chat` does).
//!
//! Scored like the retrieval tasks ([`super::retrieval`]): whether the greedy answer holds the
//! code, and the teacher-forced NLL of its digits; beside them the last turn's prefill time.

use std::time::Instant;

use anyhow::Result;
use ridgefill::interrupt;
use ridgefill::io::chat::ChatMessage;
use ridgefill::io::checkpoint::Checkpoint;
use ridgefill::model::fill::{FillHistory, FillOptions, FillReport, Prefill, settle};
use ridgefill::model::{Decoder, KvCache, Tensor, to_host_f32};
use ridgefill::session::Loaded;

use super::methods::{EvalMethod, Header, Runner};
use super::retrieval::answer_and_key_nll;
use super::tasks::{ANSWER_TOKENS, FACTS, Layout, Prose, Task, digit_positions};
use crate::commands::common::{Bar, reusable_prefix};

/// Relative depths of the code in the first turn's document.
const DEPTHS: [f64; 5] = [0.1, 0.3, 0.5, 0.7, 0.9];
/// Sentences of the unrelated passage of the second turn (the prose's first; the document's
/// follow).
const PASSAGE_SENTENCES: usize = 12;
const FIRST_ASK: &str = "\n\nPlease read this document carefully; I will ask you about it later.";
const FIRST_REPLY: &str = "I have read the document. What would you like to know?";
const SECOND_ASK: &str = "\n\nWhat is this passage about, in one sentence?";
const SECOND_REPLY: &str = "It is a passage from a story.";

#[derive(Debug, thiserror::Error)]
pub enum TurnsError {
    #[error("{0}: the model has no chat template, and --task passkey-turns talks through it")]
    NoChatTemplate(std::path::PathBuf),
    #[error(
        "--task passkey-turns, length {length}: the turns without the document already take \
         {tokens} tokens: raise --lengths"
    )]
    TooShort { length: usize, tokens: usize },
    #[error("--task passkey-turns: the prose is too short for a {length}-token conversation")]
    NotEnoughProse { length: usize },
    #[error(
        "--task passkey-turns: turn {turn}'s prompt does not start with the previous turn's \
         prompt: the chat template re-renders earlier turns, so a cache cannot be reused"
    )]
    NotAPrefix { turn: usize },
    #[error("--task passkey-turns: the code {key:?} tokenizes to no digit token after the cue")]
    NoDigits { key: String },
}

/// One conversation: each turn's prompt (rendered with the assistant's cue, the last one with
/// the answer's opening words), and the reply tokens decoded after each earlier turn.
struct Conversation {
    prompts: Vec<Vec<u32>>,
    replies: Vec<Vec<u32>>,
    /// `" " + key` as it continues the last prompt.
    cont: Vec<u32>,
    /// Indices into `cont` of the key's digit tokens.
    digits: Vec<usize>,
    key: String,
    depth: f64,
}

/// The tokens of `messages` rendered by the template with the assistant's cue, plus `cue`.
fn render(ckpt: &Checkpoint, messages: &[ChatMessage], cue: &str) -> Result<Vec<u32>> {
    let tmpl = ckpt
        .chat_template
        .as_ref()
        .ok_or_else(|| TurnsError::NoChatTemplate(ckpt.path.clone()))?;
    let text = tmpl.render(messages, true)? + cue;
    Ok(ckpt.tokenizer.encode(&text, false)?)
}

impl Conversation {
    /// The conversation whose document holds the first `k` sentences of `units`, the fact at
    /// `depth`.
    fn build(
        ckpt: &Checkpoint,
        units: &[String],
        passage: &str,
        k: usize,
        (depth, (object, code)): (f64, (&str, u32)),
    ) -> Result<Self> {
        let layout = Layout {
            header: "",
            units,
            needles: vec![(depth, format!("The secret code of the {object} is {code}."))],
            question: String::new(),
        };
        let ask = format!(
            "Back to the document: what is the secret code of the {object}? Answer with the number."
        );
        let cue = format!("The secret code of the {object} is");
        let turns = [
            (layout.text(k) + FIRST_ASK, FIRST_REPLY),
            (format!("{passage}{SECOND_ASK}"), SECOND_REPLY),
            (ask, ""),
        ];
        let mut messages = Vec::new();
        let (mut prompts, mut replies) = (Vec::new(), Vec::new());
        for (i, (user, reply)) in turns.iter().enumerate() {
            messages.push(ChatMessage::new("user", user));
            let last = i + 1 == turns.len();
            prompts.push(render(ckpt, &messages, if last { &cue } else { "" })?);
            if !last {
                replies.push(ckpt.tokenizer.encode(reply, false)?);
                messages.push(ChatMessage::new("assistant", *reply));
            }
        }
        for t in 1..prompts.len() {
            if !prompts[t].starts_with(&prompts[t - 1]) {
                return Err(TurnsError::NotAPrefix { turn: t + 1 }.into());
            }
        }
        let key = code.to_string();
        let last = prompts.last().map_or(0, Vec::len);
        let joint = render(ckpt, &messages, &format!("{cue} {key}"))?;
        let cont = joint.get(last..).unwrap_or_default().to_vec();
        let digits = digit_positions(&ckpt.tokenizer, &cont)?;
        if digits.is_empty() || !joint.starts_with(&prompts[prompts.len() - 1]) {
            return Err(TurnsError::NoDigits { key }.into());
        }
        Ok(Self {
            prompts,
            replies,
            cont,
            digits,
            key,
            depth,
        })
    }

    fn len(&self) -> usize {
        self.prompts.last().map_or(0, Vec::len)
    }
}

/// The conversations at `length` tokens: the longest document that keeps the last prompt
/// within `length`, one conversation per depth.
fn conversations(ckpt: &Checkpoint, prose: &Prose, length: usize) -> Result<Vec<Conversation>> {
    // The passage first: what `Prose::load` gathers for a longer run only adds to the end, so
    // a length's conversations do not depend on the other lengths asked for.
    let sentences = prose.sentences();
    let cut = PASSAGE_SENTENCES.min(sentences.len());
    let passage = sentences[..cut].join(" ");
    let units = &sentences[cut..];
    let mut out = Vec::with_capacity(DEPTHS.len());
    for (&depth, &fact) in DEPTHS.iter().zip(FACTS.iter()) {
        let build = |k| Conversation::build(ckpt, units, &passage, k, (depth, fact));
        let empty = build(0)?;
        if empty.len() > length {
            return Err(TurnsError::TooShort {
                length,
                tokens: empty.len(),
            }
            .into());
        }
        if build(units.len())?.len() <= length {
            return Err(TurnsError::NotEnoughProse { length }.into());
        }
        // Invariant: `lo` sentences fit, `hi` do not.
        let (mut lo, mut hi, mut best) = (0, units.len(), empty);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            let c = build(mid)?;
            if c.len() <= length {
                (lo, best) = (mid, c);
            } else {
                hi = mid;
            }
        }
        out.push(best);
    }
    Ok(out)
}

/// How one method answered one conversation.
struct Answer {
    depth: f64,
    hit: bool,
    text: String,
    /// Summed NLL of the key's digit tokens.
    nll: f64,
    /// Seconds of the last turn's prefill (time to its first token).
    last_secs: f64,
    /// Last-turn prompt rows taken from the cache.
    reused: usize,
    /// Rows filled in an earlier turn that the last turn re-ran exactly.
    restored: usize,
    report: Option<FillReport>,
}

/// What the last turn's prefill left.
struct LastTurn {
    /// Last-position logits, `[vocab]`.
    logits: Tensor<1>,
    secs: f64,
    report: Option<FillReport>,
    /// Prompt rows taken from the cache.
    reused: usize,
}

/// How a conversation's turns are prefilled.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Turns {
    /// The last prompt alone, cold.
    Cold,
    /// Turn by turn over one cache.
    Reuse,
    /// Turn by turn, every filled row settled between turns (untimed: the user's pause).
    Settled,
}

impl Turns {
    /// The method name's suffix.
    fn suffix(self) -> &'static str {
        match self {
            Turns::Cold => "",
            Turns::Reuse => "+reuse",
            Turns::Settled => "+reuse+settle",
        }
    }
}

/// The last turn after `runner` prefilled the conversation as `mode` says.
fn prefill_turns(
    model: &Decoder,
    runner: &Runner,
    c: &Conversation,
    mode: Turns,
    cache: &mut KvCache,
) -> Result<LastTurn> {
    let maps = runner.maps().filter(|_| runner.method != EvalMethod::Full);
    let opts = maps.map(|m| FillOptions::fill(m, runner.rows));
    let turns: &[Vec<u32>] = match mode {
        Turns::Cold => &c.prompts[c.prompts.len() - 1..],
        Turns::Reuse | Turns::Settled => &c.prompts,
    };
    let mut cached: Vec<u32> = Vec::new();
    let mut history: Option<FillHistory> = None;
    for (t, prompt) in turns.iter().enumerate() {
        let last = t + 1 == turns.len();
        // A filled cache without its history cannot be resumed (every fill leaves one).
        let resumable = opts.is_none() || history.is_some();
        let p = if resumable {
            reusable_prefix(&cached, prompt, model.reuse_min_rows())
        } else {
            0
        };
        cache.truncate(p);
        if let Some(h) = history.as_mut() {
            h.truncate(p);
        }
        let t0 = Instant::now();
        let (logits, report) = match opts {
            None => (model.prefill(&prompt[p..], cache)?, None),
            Some(o) => {
                let f = Prefill::over(model, prompt, cache, history.take(), o)?.finish(cache)?;
                history = f.history;
                (f.logits, Some(f.report))
            }
        };
        // Read back: the prefill's time includes its logits, as a client's first token does.
        to_host_f32(logits.clone());
        let secs = t0.elapsed().as_secs_f64();
        if last {
            return Ok(LastTurn {
                logits,
                secs,
                report,
                reused: p,
            });
        }
        // The assistant's reply, decoded: every layer exact.
        model.prefill(&c.replies[t], cache)?;
        if let (Turns::Settled, Some(h)) = (mode, history.as_mut()) {
            settle(model, cache, h, usize::MAX)?;
        }
        cached = prompt.clone();
        cached.extend_from_slice(&c.replies[t]);
    }
    unreachable!("a conversation has a last turn")
}

/// One method's answer to `c`: its prefill (cold or turn by turn), the greedy answer, and the
/// key's NLL teacher-forced from a copy of the cache.
fn ask(
    model: &Decoder,
    ckpt: &Checkpoint,
    runner: &Runner,
    c: &Conversation,
    mode: Turns,
) -> Result<Answer> {
    let n = c.len();
    let mut cache = model.new_cache(n + ANSWER_TOKENS.max(c.cont.len()));
    let last = prefill_turns(model, runner, c, mode, &mut cache)?;
    let report = last.report;
    let (text, nll) = answer_and_key_nll(
        model,
        &ckpt.tokenizer,
        last.logits,
        &mut cache,
        &c.cont,
        &c.digits,
    )?;
    Ok(Answer {
        depth: c.depth,
        hit: text.contains(&c.key),
        text,
        nll,
        last_secs: last.secs,
        reused: last.reused,
        restored: report.map_or(0, |r| r.restored),
        report,
    })
}

/// One method × reuse at one length.
struct Outcome {
    length: usize,
    method: String,
    answers: Vec<Answer>,
    digits: usize,
}

impl Outcome {
    fn accuracy(&self) -> f64 {
        self.answers.iter().filter(|a| a.hit).count() as f64 / self.answers.len().max(1) as f64
    }

    fn key_nll(&self) -> f64 {
        self.answers.iter().map(|a| a.nll).sum::<f64>() / self.digits.max(1) as f64
    }

    fn last_ms(&self) -> f64 {
        1e3 * self.answers.iter().map(|a| a.last_secs).sum::<f64>()
            / self.answers.len().max(1) as f64
    }
}

/// Runs the conversations at every length with full prefill and the fill file's shipped method
/// (`runners`' `full` and `fill`), each cold and with reuse, and prints a table or JSON.
pub fn run(
    loaded: &Loaded,
    runners: &[Runner],
    lengths: &[usize],
    prose: &Prose,
    header: &Header,
    json: bool,
) -> Result<()> {
    let model = &loaded.model;
    let ckpt = &loaded.ckpt;
    let chosen: Vec<&Runner> = runners
        .iter()
        .filter(|r| matches!(r.name(), "full" | "fill"))
        .collect();
    // Settling only changes what a fill left.
    let modes = |r: &Runner| match r.name() {
        "fill" => vec![Turns::Cold, Turns::Reuse, Turns::Settled],
        _ => vec![Turns::Cold, Turns::Reuse],
    };
    let total = lengths.len() * DEPTHS.len() * chosen.iter().map(|r| modes(r).len()).sum::<usize>();
    let bar = Bar::new(
        total as u64,
        "passkey-turns [{bar:30}] {pos}/{len} ETA {eta}",
    );
    let mut outcomes = Vec::new();
    for &length in lengths {
        interrupt::check()?;
        let convs = conversations(ckpt, prose, length)?;
        for r in &chosen {
            for mode in modes(r) {
                let method = format!("{}{}", r.name(), mode.suffix());
                let mut o = Outcome {
                    length,
                    method,
                    answers: Vec::new(),
                    digits: 0,
                };
                for c in &convs {
                    interrupt::check()?;
                    o.answers.push(ask(model, ckpt, r, c, mode)?);
                    o.digits += c.digits.len();
                    bar.inc(1);
                }
                outcomes.push(o);
            }
        }
    }
    bar.finish_and_clear();
    if json {
        print_json(&outcomes, header);
    } else {
        print_table(&outcomes, header);
    }
    Ok(())
}

fn print_json(outcomes: &[Outcome], h: &Header) {
    let rows: Vec<serde_json::Value> = outcomes
        .iter()
        .map(|o| {
            serde_json::json!({
                "task": Task::PasskeyTurns.name(),
                "length": o.length,
                "method": o.method,
                "accuracy": o.accuracy(),
                "key_nll": o.key_nll(),
                "last_turn_prefill_ms": o.last_ms(),
                "answers": o.answers.iter().map(|a| serde_json::json!({
                    "depth": a.depth,
                    "hit": a.hit,
                    "answer": a.text,
                    "key_nll": a.nll,
                    "last_turn_prefill_secs": a.last_secs,
                    "reused": a.reused,
                    "restored": a.restored,
                    "fill": a.report.map(|r| super::methods::report_json(&r)),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let out = serde_json::json!({
        "split": h.split,
        "sink": h.rows.sink,
        "tail": h.rows.tail,
        "fill_method": h.fill.json(),
        "results": rows,
    });
    println!("{out}");
}

fn print_table(outcomes: &[Outcome], h: &Header) {
    println!(
        "passkey-turns: a code in turn 1's document, an unrelated turn, asked in turn 3 \
         ({} conversations a length) | {}",
        DEPTHS.len(),
        h.describe()
    );
    println!();
    println!(
        "| length | method | accuracy | key NLL | last turn prefill ms | reused rows | restored rows | attention on filled rows | misses (depth) |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---|---|");
    for o in outcomes {
        let n = o.answers.len().max(1);
        let reused = o.answers.iter().map(|a| a.reused).sum::<usize>() / n;
        let restored = o.answers.iter().map(|a| a.restored).sum::<usize>() / n;
        // The range over conversations: what a restore threshold must stay under.
        let shares: Vec<f64> = o
            .answers
            .iter()
            .filter_map(|a| a.report.and_then(|r| r.filled_attention))
            .collect();
        let share = match shares.iter().copied().reduce(f64::min) {
            Some(lo) => {
                let hi = shares.iter().copied().fold(lo, f64::max);
                format!("{:.1}–{:.1}%", 100.0 * lo, 100.0 * hi)
            }
            None => "—".into(),
        };
        let misses: Vec<String> = o
            .answers
            .iter()
            .filter(|a| !a.hit)
            .map(|a| a.depth.to_string())
            .collect();
        println!(
            "| {} | {} | {:.2} | {:.3} | {:.0} | {reused} | {restored} | {share} | {} |",
            o.length,
            o.method,
            o.accuracy(),
            o.key_nll(),
            o.last_ms(),
            misses.join(",")
        );
    }
}
