//! Long work shows where it stands: `shoal models add` of a 2 GiB model file (the test
//! model followed by a sparse tail, so it takes no disk) draws a bar with its rate and
//! the time left on a terminal (a pseudo-terminal made by `script`), and prints plain
//! lines of how much of it is hashed otherwise; `shoal models load --wait` prints a line
//! per stage as it moves to running.

mod common;
use common::*;
use std::process::Command;

#[test]
fn models_add_and_load_show_progress_as_bars_on_a_terminal_and_as_lines_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a");
    let big = tmp.path().join("big.gguf");
    std::fs::copy(model("SmolLM2-135M-Instruct.Q4_1.gguf"), &big).unwrap();
    std::fs::OpenOptions::new().write(true).open(&big).unwrap().set_len(2 << 30).unwrap();
    let mut nodes = Nodes(vec![("a", serve_offering(&dir, "a", true, "200MiB", "1"))]);
    wait_for("the node's cluster", 30, || status(&dir).filter(|s| !s["cluster"].is_null()));

    // Not a terminal: plain lines, a tenth of the file at a time, then "done".
    let out = shoal().args(["models", "add"]).arg(&big).arg("--data-dir").arg(&dir).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("[shoal] hashing big.gguf on the node: ")).collect();
    let figures = lines.iter().filter(|l| l.contains(" of 2.0 GiB (")).count();
    assert!(figures >= 2, "hashing 2 GiB showed {figures} figure(s): {err}");
    assert!(lines.last().is_some_and(|l| l.ends_with(": done")), "{err}");
    assert!(!err.contains('\x1b') && !err.contains('\r'), "control characters without a terminal: {err:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("added big.gguf: llama 30 layers"), "{out:?}");

    // A terminal: the bar redraws in place with bytes, rate and time left.
    let cmd = format!(
        "{} models add {} --name big-again --data-dir {}",
        env!("CARGO_BIN_EXE_shoal"),
        big.display(),
        dir.display()
    );
    let out = Command::new("script").args(["-q", "-e", "-c", &cmd, "/dev/null"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("hashing big.gguf on the node ["), "no bar: {text:?}");
    assert!(text.contains("\x1b["), "the bar is not redrawn in place: {text:?}");
    assert!(text.contains("/2.00 GiB") && text.contains("B/s, ") && text.contains(" left"), "{text:?}");
    assert!(!text.contains("[shoal] hashing big.gguf on the node: "), "plain lines on a terminal: {text:?}");

    // Loading: a line per stage until it runs (one node: one stage).
    let load = ["models", "load", "big.gguf", "--context", "256", "--wait", "--data-dir"];
    let out = shoal().args(load).arg(&dir).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("[shoal] stage 0 (layers 0..30) on ") && err.contains(": running"), "{err}");
    nodes.kill_all();
}
