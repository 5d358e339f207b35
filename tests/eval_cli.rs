//! `ridgefill eval` end to end on the tiny model: text mode reports every method with its FLOPs,
//! the retrieval tasks report one self-contained row per task × length × method, and lengths
//! beyond the context are typed errors.

mod common;

use std::path::Path;

use common::ridgefill;
use ridgefill_testkit::{cli, tiny};

/// The tiny model's context here: its fixture's is too short for a haystack around the facts.
const CONTEXT: usize = 512;
/// Positions `eval` keeps free after a retrieval prompt (its greedy answer tokens).
const ANSWER_TOKENS: usize = 8;
/// Prompt lengths: the longest fact-and-question text (`multi`) takes about 250 tokens, and the
/// longest length fills the context exactly.
const LENGTHS: [usize; 2] = [280, CONTEXT - ANSWER_TOKENS];
const METHODS: [&str; 6] = ["full", "fill", "ridge", "spans", "drop", "own-proj"];
const TASKS: [&str; 4] = ["passkey", "passkey-first", "prose", "multi"];

/// The tiny model as a HF directory with a `CONTEXT` context, prose, and a fill file fitted on
/// that prose (split 1).
struct Setup {
    _dir: tempfile::TempDir,
    model: String,
    prose: String,
    fill: String,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    tiny::write_hf_dir(&tiny::tiny(), &model, &tiny::Faults::default());
    let mut config = tiny::config_json();
    config["max_position_embeddings"] = CONTEXT.into();
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let prose = dir.path().join("prose");
    std::fs::create_dir(&prose).unwrap();
    for i in 0..3 {
        std::fs::write(prose.join(format!("doc{i}.txt")), tiny::words(800, i + 1)).unwrap();
    }
    let fill = dir.path().join("tiny.fill");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (ok, _, stderr) = ridgefill(&cli::fit_args(&s(&model), &s(&prose), &s(&fill)));
    assert!(ok, "fit: {stderr}");
    Setup {
        model: s(&model),
        prose: s(&prose),
        fill: s(&fill),
        _dir: dir,
    }
}

fn eval(s: &Setup, extra: &[&str]) -> (bool, String, String) {
    let mut args = vec![
        "eval", "-m", &s.model, "--device", "cpu", "--fill", &s.fill, "--tail", "4",
    ];
    args.extend_from_slice(extra);
    ridgefill(&args)
}

fn num(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"))
}

#[test]
fn eval_text_and_retrieval_report_every_method() {
    let s = setup();
    let methods = METHODS.join(",");

    // Text mode: every method, `fill` named, FLOPs relative to full.
    let (ok, stdout, stderr) = eval(
        &s,
        &[
            "--text",
            &s.prose,
            "--prefix",
            "48",
            "--cont",
            "8",
            "--max-windows",
            "2",
            "--methods",
            &methods,
            "--json",
        ],
    );
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(v["fill_method"]["name"].is_string(), "{v}");
    for m in METHODS {
        let r = &v["methods"][m];
        for key in ["nll", "kl", "top1", "exact", "flops_ratio"] {
            assert!(num(r, key).is_finite(), "{m}.{key} in {v}");
        }
    }
    assert_eq!(num(&v["methods"]["full"], "flops_ratio"), 1.0);
    assert_eq!(num(&v["methods"]["full"], "kl"), 0.0);
    assert_eq!(num(&v["methods"]["ridge"], "exact"), 0.0);
    assert!(num(&v["methods"]["drop"], "flops_ratio") < 1.0, "{v}");

    // Retrieval: one row per task × length × method, with the run's settings in each.
    let lengths: Vec<String> = LENGTHS.iter().map(usize::to_string).collect();
    let (ok, stdout, stderr) = eval(
        &s,
        &[
            "--task",
            &TASKS.join(","),
            "--lengths",
            &lengths.join(","),
            "--text",
            &s.prose,
            "--methods",
            &methods,
            "--json",
        ],
    );
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let rows = v["results"].as_array().expect("results");
    assert_eq!(rows.len(), TASKS.len() * LENGTHS.len() * METHODS.len());
    for r in rows {
        for key in ["accuracy", "key_nll", "flops_ratio", "exact", "fill_exact"] {
            assert!(num(r, key).is_finite(), "{key} in {r}");
        }
        assert!((0.0..=1.0).contains(&num(r, "accuracy")), "{r}");
        assert!(num(r, "key_nll") > 0.0, "{r}");
        assert_eq!(r["split"], 1, "{r}");
        assert_eq!(r["tail"], 4, "{r}");
        assert_eq!(r["sink"], 1, "{r}");
        assert_eq!(r["fill_method"], v["fill_method"], "{r}");
        assert!(TASKS.contains(&r["task"].as_str().unwrap()), "{r}");
        assert!(METHODS.contains(&r["method"].as_str().unwrap()), "{r}");
        // One answer per question; whether the key ran exactly only where spans are chosen.
        let answers = r["answers"].as_array().expect("answers");
        assert_eq!(answers.len() as f64, num(r, "queries"), "{r}");
        let hits = answers.iter().filter(|a| a["hit"] == true).count();
        assert_eq!(
            hits as f64 / answers.len() as f64,
            num(r, "accuracy"),
            "{r}"
        );
        for a in answers {
            assert!(a["answer"].is_string() && num(a, "depth") > 0.0, "{a}");
        }
        let spans = ["fill", "spans"].contains(&r["method"].as_str().unwrap());
        assert_eq!(r["key_covered"].is_number(), spans, "{r}");
        assert_eq!(answers[0]["key_covered"].is_boolean(), spans, "{r}");
        if r["method"] == "full" {
            // Full against itself: 1.0, or undefined when it gets nothing right.
            match r["relative_accuracy"].as_f64() {
                Some(rel) => assert_eq!(rel, 1.0, "{r}"),
                None => assert_eq!(num(r, "accuracy"), 0.0, "{r}"),
            }
            assert_eq!(num(r, "flops_ratio"), 1.0, "{r}");
        }
    }

    // The oracle: plain ridge, then restored parts; restoring everything gives full's key NLL.
    let at = |method: &str| {
        rows.iter()
            .find(|r| r["task"] == "passkey" && r["length"] == LENGTHS[0] && r["method"] == method)
            .map(|r| num(r, "key_nll"))
            .unwrap()
    };
    let (ok, stdout, stderr) = eval(
        &s,
        &[
            "--task",
            "passkey",
            "--lengths",
            &lengths[0],
            "--oracle",
            "--json",
        ],
    );
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let oracle = v["results"].as_array().expect("results");
    // Ridge, all, keys, values, the key's rows, then each upper layer (split 1).
    assert_eq!(oracle.len(), 5 + tiny::LAYERS - 1, "{v}");
    let restored = |name: &str| {
        oracle
            .iter()
            .find(|r| r["restored"] == name)
            .map(|r| num(r, "key_nll"))
            .unwrap_or_else(|| panic!("{name} in {v}"))
    };
    assert!((restored("ridge") - at("ridge")).abs() < 1e-4, "{v}");
    assert!((restored("true K+V") - at("full")).abs() < 1e-3, "{v}");

    // `--passkey` is `--task passkey`, with full first even when not listed.
    let (ok, stdout, stderr) = eval(&s, &["--passkey", "--lengths", "200", "--methods", "drop"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("| passkey | 200 | full |"), "{stdout}");
    assert!(stdout.contains("| passkey | 200 | drop |"), "{stdout}");
}

#[test]
fn eval_refuses_lengths_it_cannot_run() {
    let s = setup();
    let too_long = (CONTEXT - ANSWER_TOKENS + 1).to_string();
    let (ok, _, stderr) = eval(&s, &["--passkey", "--lengths", &too_long]);
    assert!(!ok);
    assert!(
        stderr.contains(&format!("the model's context is {CONTEXT}")),
        "{stderr}"
    );
    // Too short for the fact and question alone.
    let (ok, _, stderr) = eval(
        &s,
        &["--task", "multi", "--lengths", "64", "--text", &s.prose],
    );
    assert!(!ok);
    assert!(stderr.contains("raise --lengths"), "{stderr}");
    let (ok, _, stderr) = eval(&s, &["--task", "riddle"]);
    assert!(!ok);
    assert!(stderr.contains("riddle"), "{stderr}");
    // A RULER sample index past --samples.
    let (ok, _, stderr) = eval(
        &s,
        &["--task", "niah_single_1", "--samples", "2", "--pick", "0,2"],
    );
    assert!(!ok);
    assert!(
        stderr.contains("--pick 2: only samples 0..2 exist"),
        "{stderr}"
    );
}

/// `--task answers` on a one-document question set: every method and the floor (full prefill
/// with `--weights f32`) answer each question, full agrees with itself, every answer's text is
/// in the JSON, and the task refuses company.
#[test]
fn eval_answers_compares_every_method_with_full_and_the_floor() {
    let s = setup();
    let dir = tempfile::tempdir().unwrap();
    // About 160 tokens of the tiny tokenizer: room in the 512-token context for the template,
    // the question and the answer.
    let doc = tiny::words(40, 9);
    std::fs::write(dir.path().join("doc.txt"), &doc).unwrap();
    let evidence = doc.split(' ').take(3).collect::<Vec<_>>().join(" ");
    let set = dir.path().join("questions.toml");
    let question = |ask: &str| {
        format!("[[document.question]]\nask = {ask:?}\nanswer = \"x\"\nevidence = {evidence:?}\n")
    };
    std::fs::write(
        &set,
        format!(
            "[[document]]\nfile = \"doc.txt\"\nkind = \"prose\"\n{}{}",
            question("where did the cat sit ?"),
            question("where did the dogs run ?")
        ),
    )
    .unwrap();
    let set = set.to_str().unwrap();
    let methods = ["full", "fill", "ridge"];
    let args = |json: bool| {
        let mut a = vec![
            "--task",
            "answers",
            "--questions",
            set,
            "--answer-tokens",
            "6",
            "--methods",
            "full,fill,ridge",
        ];
        if json {
            a.push("--json");
        }
        a
    };
    let (ok, stdout, stderr) = eval(&s, &args(true));
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["questions"], 2, "{v}");
    assert_eq!(v["answer_tokens"], 6, "{v}");
    for m in methods.iter().chain(&["floor"]) {
        let r = &v["methods"][m];
        assert_eq!(r["questions"], 2, "{m} in {v}");
        for key in ["rouge_l", "prefill_secs", "speedup", "flops_ratio"] {
            assert!(num(r, key).is_finite(), "{m}.{key} in {v}");
        }
        assert!((0.0..=1.0).contains(&num(r, "rouge_l")), "{m} in {v}");
        assert!(r["rouge_l_per_kind"]["prose"].is_number(), "{m} in {v}");
    }
    let full = &v["methods"]["full"];
    assert_eq!(
        (&full["identical"], &full["first_sentence"]),
        (&2.into(), &2.into())
    );
    assert_eq!(num(full, "rouge_l"), 1.0);
    assert_eq!(num(full, "speedup"), 1.0);
    assert_eq!(num(full, "flops_ratio"), 1.0);
    assert!(num(&v["methods"]["fill"], "flops_ratio") < 1.0, "{v}");
    let answers = v["answers"].as_array().expect("answers");
    assert_eq!(answers.len(), 2, "{v}");
    for a in answers {
        for m in methods.iter().chain(&["floor"]) {
            assert!(a["answers"][m]["text"].is_string(), "{m} in {a}");
        }
        assert_eq!(a["answers"]["full"]["identical"], true, "{a}");
        assert_eq!(a["kind"], "prose", "{a}");
    }

    // The table: one row per method, the floor's, a column per kind of document.
    let (ok, stdout, stderr) = eval(&s, &args(false));
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("| full | 2/2 | 2/2 | 1.000 ± 0.000 |"),
        "{stdout}"
    );
    assert!(
        stdout.contains("| floor (full f32 vs native) |"),
        "{stdout}"
    );
    assert!(stdout.contains("ROUGE-L prose"), "{stdout}");

    let (ok, _, stderr) = eval(&s, &["--task", "answers,passkey", "--questions", set]);
    assert!(!ok);
    assert!(stderr.contains("runs alone"), "{stderr}");
}

/// RULER's context here: its prompts in the tiny model's byte-level tokens need a longer one
/// than the retrieval tests' (cwe's worked example alone is some 1,500 tokens).
const RULER_CONTEXT: usize = 3072;
/// RULER's eleven synthetic tasks, as `--task ruler` expands.
const RULER_TASKS: [&str; 11] = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
];

/// `--task ruler` on the tiny model: one row per task × method with its samples' answers, prompts
/// that fill the length with the answer budget, full's scores relative to itself, a summary;
/// a task's samples do not depend on which others run; impossible runs are refused by name.
#[test]
fn eval_ruler_scores_every_task_and_method() {
    let s = setup();
    let mut config = tiny::config_json();
    config["max_position_embeddings"] = RULER_CONTEXT.into();
    std::fs::write(Path::new(&s.model).join("config.json"), config.to_string()).unwrap();
    let length = RULER_CONTEXT.to_string();
    let run = |tasks: &str| {
        let (ok, stdout, stderr) = eval(
            &s,
            &[
                "--task",
                tasks,
                "--lengths",
                &length,
                "--samples",
                "1",
                "--methods",
                "fill",
                "--text",
                &s.prose,
                "--json",
            ],
        );
        assert!(ok, "{stderr}");
        serde_json::from_str::<serde_json::Value>(stdout.trim()).unwrap()
    };
    let v = run("ruler");
    assert_eq!(v["benchmark"], "ruler", "{v}");
    let rows = v["results"].as_array().expect("results");
    assert_eq!(rows.len(), RULER_TASKS.len() * 2, "{v}");
    for r in rows {
        assert!(RULER_TASKS.contains(&r["task"].as_str().unwrap()), "{r}");
        assert_eq!(r["length"], RULER_CONTEXT, "{r}");
        assert!((0.0..=100.0).contains(&num(r, "score")), "{r}");
        assert!(
            num(r, "prefill_secs") > 0.0 && num(r, "speedup") > 0.0,
            "{r}"
        );
        let answers = r["answers"].as_array().expect("answers");
        assert_eq!(answers.len(), 1, "{r}");
        let a = &answers[0];
        let used = num(a, "prompt_tokens") + num(r, "max_new");
        assert!(
            used <= RULER_CONTEXT as f64 && used > 0.9 * RULER_CONTEXT as f64,
            "{r}"
        );
        assert!(!a["references"].as_array().unwrap().is_empty(), "{a}");
        assert!(
            a["answer"].is_string() && (0.0..=1.0).contains(&num(a, "score")),
            "{a}"
        );
        if r["method"] == "full" {
            assert_eq!(num(r, "flops_ratio"), 1.0, "{r}");
            assert_eq!(a["same_as_full"], true, "{r}");
            if let Some(rel) = r["relative_score"].as_f64() {
                assert_eq!(rel, 1.0, "{r}");
            }
        } else {
            assert!(num(r, "flops_ratio") < 1.0, "{r}");
        }
    }
    let summary = v["summary"].as_array().expect("summary");
    assert_eq!(summary.len(), 2, "{v}");
    assert_eq!(num(&summary[0], "speedup"), 1.0, "{v}");

    // The same samples and answers when a task runs with others or alone.
    let alone = run("vt,niah_single_1");
    for r in alone["results"].as_array().expect("results") {
        let same = rows
            .iter()
            .find(|x| x["task"] == r["task"] && x["method"] == r["method"])
            .unwrap();
        for key in ["references", "answer", "prompt_tokens"] {
            assert_eq!(r["answers"][0][key], same["answers"][0][key], "{key}: {r}");
        }
    }

    let (ok, _, stderr) = eval(&s, &["--task", "ruler", "--lengths", "200"]);
    assert!(!ok);
    assert!(stderr.contains("raise --lengths"), "{stderr}");
    let (ok, _, stderr) = eval(&s, &["--task", "vt", "--oracle"]);
    assert!(!ok);
    assert!(stderr.contains("--oracle"), "{stderr}");
}

/// `--task passkey-turns` on the tiny model: full and fill, each cold and turn by turn over
/// the cache (fill also with its rows settled between turns); reuse takes most of the last turn
/// from the cache, full prefill with reuse answers exactly as cold full prefill does, and a
/// settled conversation's last turn restores nothing.
#[test]
fn eval_passkey_turns_compares_cold_and_reused_prefills() {
    let s = setup();
    let mut config = tiny::config_json();
    config["max_position_embeddings"] = RULER_CONTEXT.into();
    std::fs::write(Path::new(&s.model).join("config.json"), config.to_string()).unwrap();
    // One sentence a line: the document's and the second turn's passage's units.
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..300).map(|i| tiny::words(8, 100 + i) + " .").collect();
    std::fs::write(dir.path().join("prose.txt"), lines.join("\n")).unwrap();
    let prose = dir.path().join("prose.txt");
    let (ok, stdout, stderr) = eval(
        &s,
        &[
            "--task",
            "passkey-turns",
            "--lengths",
            "1500",
            "--methods",
            "full,fill",
            "--text",
            prose.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let rows = v["results"].as_array().expect("results");
    let methods: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    assert_eq!(
        methods,
        [
            "full",
            "full+reuse",
            "fill",
            "fill+reuse",
            "fill+reuse+settle"
        ],
        "{v}"
    );
    let row = |m: &str| rows.iter().find(|r| r["method"] == m).unwrap();
    for r in rows {
        assert_eq!(r["task"], "passkey-turns", "{r}");
        let answers = r["answers"].as_array().expect("answers");
        assert_eq!(answers.len(), 5, "{r}");
        let reuse = r["method"].as_str().unwrap().contains("+reuse");
        for a in answers {
            assert!(num(a, "last_turn_prefill_secs") > 0.0, "{a}");
            // The last turn's prompt is within the length; reuse keeps all but its last rows.
            let reused = num(a, "reused");
            assert!(if reuse { reused > 500.0 } else { reused == 0.0 }, "{a}");
        }
    }
    for (cold, warm) in row("full")["answers"]
        .as_array()
        .unwrap()
        .iter()
        .zip(row("full+reuse")["answers"].as_array().unwrap())
    {
        assert_eq!(cold["answer"], warm["answer"], "{cold} vs {warm}");
        let d = (num(cold, "key_nll") - num(warm, "key_nll")).abs();
        assert!(d < 1e-3, "{cold} vs {warm}");
    }
    for a in row("fill+reuse")["answers"].as_array().unwrap() {
        assert!(a["fill"]["filled"].is_number(), "{a}");
    }
    for a in row("fill+reuse+settle")["answers"].as_array().unwrap() {
        assert_eq!(num(a, "restored"), 0.0, "{a}");
    }

    // A length the fixed turns alone exceed, and prose too short for the document.
    let prose = prose.to_str().unwrap();
    let turns = |length: &str, text: &str| {
        let args = [
            "--task",
            "passkey-turns",
            "--lengths",
            length,
            "--text",
            text,
        ];
        let (ok, _, stderr) = eval(&s, &args);
        assert!(!ok, "--lengths {length}");
        stderr
    };
    let stderr = turns("64", prose);
    assert!(stderr.contains("raise --lengths"), "{stderr}");
    let short = dir.path().join("short.txt");
    std::fs::write(&short, lines[..14].join("\n")).unwrap();
    let stderr = turns("2000", short.to_str().unwrap());
    assert!(stderr.contains("prose is too short"), "{stderr}");
}
