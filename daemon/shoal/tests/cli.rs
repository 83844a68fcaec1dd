//! The `shoal` binary end to end: `run --json` split and unsplit agree, errors are
//! clear and exit non-zero without a panic, and the benchmark prints its table.

mod common;
use common::model;
use serde_json::Value;
use std::process::{Command, Output};

fn shoal(args: &[&str], cache: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shoal")).args(args).arg("--cache").arg(cache).output().unwrap()
}

fn json_run(extra: &[&str], cache: &std::path::Path) -> Value {
    let m = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut args = vec!["run", "--model", m.to_str().unwrap(), "--prompt", "Name three colours.", "-n", "24", "--json"];
    args.extend_from_slice(extra);
    let out = shoal(&args, cache);
    assert!(out.status.success(), "shoal run failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("run --json prints one JSON object")
}

#[test]
fn run_json_split_equals_unsplit() {
    let dir = tempfile::tempdir().unwrap();
    let whole = json_run(&[], dir.path());
    let split = json_run(&["--split", "10,20"], dir.path());
    for key in ["tokens", "text", "logits_digest"] {
        assert_eq!(whole[key], split[key], "{key} differs between split and unsplit runs");
    }
    let tokens = whole["tokens"].as_array().unwrap();
    assert!(!tokens.is_empty() && tokens.len() <= 24);
    assert!(!whole["text"].as_str().unwrap().is_empty());
    assert!(whole["tok_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(whole["stages"], serde_json::json!([{"start": 0, "end": 30}]));
    assert_eq!(
        split["stages"],
        serde_json::json!([{"start": 0, "end": 10}, {"start": 10, "end": 20}, {"start": 20, "end": 30}])
    );
    assert_eq!(split["memory"].as_array().unwrap().len(), 3);
}

fn assert_fails(args: &[&str], want: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = shoal(args, dir.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "expected a clean failure, got {:?}: {err}", out.status);
    assert!(err.contains(want), "stderr does not say {want:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_inputs_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"GGUF\x03\0\0\0garbage").unwrap();
    let junk = junk.to_str().unwrap();
    assert_fails(&["run", "--model", junk, "--prompt", "hi"], "junk.gguf: truncated GGUF");
    assert_fails(&["run", "--model", "/nonexistent.gguf", "--prompt", "hi"], "/nonexistent.gguf");
    let gemma = model("gemma-3-270m-q4_k_m.gguf");
    assert_fails(&["run", "--model", gemma.to_str().unwrap(), "--split", "18", "--prompt", "hi"], "between 1 and 17");
    let smol = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let smol = smol.to_str().unwrap();
    assert_fails(&["run", "--model", smol, "--split", "20,10", "--prompt", "hi"], "strictly increasing");
    let long = "word ".repeat(400);
    assert_fails(&["run", "--model", smol, "--ctx", "256", "--prompt", &long], "no room in the context");
}

#[test]
fn presence_and_frequency_penalties_change_a_greedy_answer_the_same_split_or_not() {
    let dir = tempfile::tempdir().unwrap();
    let smol = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let run = |extra: &[&str]| -> Value {
        let mut args = vec!["run", "--model", smol.to_str().unwrap(), "--json", "--ignore-eos"];
        args.extend(["--prompt", "List the colours of the rainbow, again and again.", "-n", "80"]);
        args.extend(extra);
        let out = shoal(&args, dir.path());
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let plain = run(&[]);
    for penalty in [["--presence-penalty", "1.5"], ["--frequency-penalty", "1.0"]] {
        let whole = run(&penalty);
        assert_ne!(whole["tokens"], plain["tokens"], "{penalty:?} changed nothing");
        // A penalised token comes back less often: the answer has more distinct tokens.
        let distinct = |v: &Value| {
            v["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_i64().unwrap())
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        };
        assert!(distinct(&whole) > distinct(&plain), "{penalty:?}: {} vs {}", distinct(&whole), distinct(&plain));
        let split = run(&[&penalty[..], &["--split", "15"]].concat());
        assert_eq!(split["tokens"], whole["tokens"], "{penalty:?}");
        assert_eq!(split["logits_digest"], whole["logits_digest"], "{penalty:?}");
    }
    assert_fails(
        &["run", "--model", smol.to_str().unwrap(), "--prompt", "hi", "--presence-penalty", "2.5"],
        "presence_penalty 2.5 is outside",
    );
}

#[test]
fn a_grammar_keeps_the_answer_within_it_split_or_not_and_a_bad_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let smol = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let schema = serde_json::json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
        "colours": {"type": "array", "items": {"enum": ["black", "white", "orange"]}, "minItems": 1, "maxItems": 2}}});
    for (grammar, what) in
        [(shoal_api::grammar::json_object(), "json"), (shoal_api::grammar::from_schema(&schema).unwrap(), "schema")]
    {
        let file = dir.path().join(format!("{what}.gbnf"));
        std::fs::write(&file, grammar).unwrap();
        let run = |split: Option<&str>| -> Value {
            let mut args =
                vec!["run", "--model", smol.to_str().unwrap(), "--json", "--grammar", file.to_str().unwrap()];
            args.extend(["--prompt", "Describe a cat as a JSON object with its name and age.", "-n", "160"]);
            if let Some(s) = split {
                args.extend(["--split", s]);
            }
            let out = shoal(&args, dir.path());
            assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
            serde_json::from_slice(&out.stdout).unwrap()
        };
        let whole = run(None);
        let text = whole["text"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text:?}"));
        assert!(v.is_object(), "{what}: {v}");
        if what == "schema" {
            let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
            assert_eq!(keys, ["name", "age", "colours"], "in the schema's order: {v}");
            assert!(v["age"].is_i64() && v["name"].as_str().unwrap().chars().count() <= 20, "{v}");
            let colours = v["colours"].as_array().unwrap();
            assert!((1..=2).contains(&colours.len()), "{v}");
        }
        // Split in two: the same tokens and logits (the grammar lives at the tail).
        let split = run(Some("15"));
        assert_eq!(split["tokens"], whole["tokens"], "{what}");
        assert_eq!(split["logits_digest"], whole["logits_digest"], "{what}");
    }
    let bad = dir.path().join("bad.gbnf");
    std::fs::write(&bad, "root ::= ( unclosed").unwrap();
    assert_fails(
        &["run", "--model", smol.to_str().unwrap(), "--prompt", "hi", "--grammar", bad.to_str().unwrap()],
        "grammar",
    );
    let missing = dir.path().join("missing.gbnf");
    assert_fails(
        &["run", "--model", smol.to_str().unwrap(), "--prompt", "hi", "--grammar", missing.to_str().unwrap()],
        "missing.gbnf",
    );
}

#[test]
fn bench_split_prints_its_table() {
    let m = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_shoal-lab"))
        .args([
            "bench",
            "split",
            "--model",
            m.to_str().unwrap(),
            "--stages",
            "3",
            "-n",
            "8",
            "--rounds",
            "1",
            "--cache",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("split at [10, 20]"), "{text}");
    let median = text.lines().find(|l| l.trim_start().starts_with("median")).expect("median row");
    let figures: Vec<f64> = median.split_whitespace().skip(1).map(|f| f.parse().unwrap()).collect();
    assert_eq!(figures.len(), 3, "{median}");
    assert!(figures.iter().all(|f| f.is_finite() && *f > 0.0), "{median}");
    assert!(text.contains("peak RSS: unsplit"), "{text}");
    assert!(text.contains("tokens and logits identical: yes"), "{text}");
}

#[test]
fn bench_zoo_prints_every_family() {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal-lab"))
        .args(["bench", "zoo", "-n", "8", "--rounds", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains(&format!("{} families written in", shoal_gguf::zoo::Family::ALL.len())), "{text}");
    for family in shoal_gguf::zoo::Family::ALL {
        let row = text.lines().find(|l| l.split_whitespace().next() == Some(family.arch())).expect("a row per family");
        let cells: Vec<&str> = row.split_whitespace().collect();
        // family, write ms, MiB, split point, unsplit tok/s, split tok/s, ratio, identical
        assert_eq!(cells.len(), 8, "{row}");
        let figures: Vec<f64> = cells[1..7].iter().map(|f| f.parse().unwrap()).collect();
        assert!(figures.iter().all(|f| f.is_finite() && *f > 0.0), "{row}");
        assert_eq!(cells[7], "yes", "{row}");
    }
}

#[test]
fn bench_pipeline_prints_its_table() {
    let m = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_shoal-lab"))
        .args(["bench", "pipeline", "--model", m.to_str().unwrap(), "--stages", "2", "-n", "8", "--rounds", "1"])
        .args(["--prompt-tokens", "100", "--impair", "delay=1ms"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let median = text.lines().find(|l| l.trim_start().starts_with("median")).expect("median row");
    let figures: Vec<f64> = median.split_whitespace().skip(1).map(|f| f.parse().unwrap()).collect();
    assert_eq!(figures.len(), 3, "{median}");
    assert!(figures.iter().all(|f| f.is_finite() && *f > 0.0), "{median}");
    assert!(
        text.contains("per-token overhead:") && text.contains("one-way delays on a token's loop: 2.00 ms"),
        "{text}"
    );
    assert!(text.contains("time to first token"), "{text}");
    assert!(text.contains("tokens and logits identical: yes"), "{text}");
}

#[test]
fn bench_speculative_prints_its_tables() {
    let m = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_shoal-lab"))
        .args(["bench", "speculative", "--model", m.to_str().unwrap(), "-n", "24", "--rounds", "1"])
        .args(["--links", ";delay=1ms"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("a pass of n positions, unsplit, 1 thread — 1: "), "{text}");
    // Two prompts over two links: four tables of six rows (unsplit and split in each
    // configuration), each with tok/s, the ratio to unsplit without speculation, tokens
    // per step, acceptance, mean k, and whether split equals unsplit.
    let mut repetitive_accepted = None;
    for config in ["no speculation", "speculation, k fixed", "speculation, k adaptive"] {
        for place in ["unsplit", "split"] {
            let label = format!("{place}, {config} ");
            let rows: Vec<&str> = text.lines().filter(|l| l.starts_with(&label)).collect();
            assert_eq!(rows.len(), 4, "{label}: {text}");
            for row in rows {
                let cells: Vec<&str> = row[label.len()..].split_whitespace().collect();
                assert_eq!(cells.len(), 6, "{row}");
                let f: Vec<f64> = cells[..5].iter().map(|c| c.trim_end_matches('%').parse().unwrap()).collect();
                assert!(f[0] > 0.0 && f[1] > 0.0 && f[2] >= 1.0 && f[3] >= 0.0 && f[4] >= 0.0, "{row}");
                assert_eq!(cells[5], "yes", "split differs from unsplit: {row}");
                if place == "unsplit" && config == "no speculation" {
                    assert_eq!((f[1], f[2], f[4]), (1.0, 1.0, 0.0), "{row}");
                }
                if config == "speculation, k fixed" && repetitive_accepted.is_none() {
                    repetitive_accepted = Some(f[3]);
                }
            }
        }
    }
    // The repetitive prompt (the first table) has its drafts accepted.
    assert!(repetitive_accepted.unwrap() > 0.0, "{text}");
    assert_eq!(text.matches("per-token overhead of the split").count(), 8, "{text}");
}

#[test]
fn bench_keepalive_prints_both_sides() {
    let m = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_shoal-lab"))
        .args(["bench", "keepalive", "--json", "--model", m.to_str().unwrap(), "-n", "12", "--rounds", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for side in ["off", "on"] {
        let tps = v[side]["median_tok_per_s"].as_f64().unwrap();
        let cpu = v[side]["cpu_ms_per_token"].as_f64().unwrap();
        assert!(tps.is_finite() && tps > 0.0 && cpu.is_finite() && cpu >= 0.0, "{v}");
    }
    assert!(v["ratio"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["identical"], true, "{v}");
}

#[test]
fn the_demo_runs_a_local_cluster_that_splits_the_model_and_answers() {
    model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["demo", "-n", "8", "--once", "--phase", "set-up=1.5", "--phase", "build=0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // What each phase took, those timed by scripts/demo.sh first.
    let phases: Vec<(&str, f64)> = err
        .lines()
        .skip_while(|l| *l != "[demo] what each phase took:")
        .skip(1)
        .map_while(|l| l.strip_prefix("[demo]   "))
        .filter_map(|l| l.strip_suffix(" s")?.rsplit_once(' ').map(|(n, s)| (n.trim(), s.trim().parse().ok())))
        .filter_map(|(n, s)| Some((n, s?)))
        .collect();
    let names: Vec<&str> = phases.iter().map(|p| p.0).collect();
    assert_eq!(names, ["set-up", "build", "cluster formed", "model placed and loaded", "first token"], "{err}");
    assert_eq!(phases[0].1, 1.5, "{err}");
    assert!(phases[2..].iter().all(|p| p.1 > 0.0 && p.1 < 600.0), "{err}");
    assert!(err.contains("the leader placed it in 3 stages"), "{err}");
    assert_eq!(err.matches("shard fetched from").count(), 2, "{err}");
    assert!(err.contains("[demo] API: http://127.0.0.1:"), "{err}");
    assert!(err.contains("8 tokens in"), "the answer came through the API: {err}");
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty(), "no answer");
}
