//! Three hosts in Linux network namespaces on a bridge (real QUIC between separate
//! network stacks), driven through `shoal-lab bench reconnect`, which starts the stages,
//! generates, compares with the unsplit model bit for bit and fails when they differ:
//! with WiFi-like impairment on every host, and with the middle host's link taken
//! down for 3 s three times during a 400-token generation; and `shoal-lab bench replace
//! --netns` (plain nodes, a stage's node killed). Needs root (`ip netns`);
//! without it each test says it skipped, and why. The bench removes its namespaces
//! and processes when it ends (checked here).

mod common;
use common::*;
use serde_json::Value;

/// Run the bench; checks that it removed its namespaces.
fn bench(args: &[&str]) -> Value {
    model("SmolLM2-135M-Instruct.Q4_1.gguf");
    json(run_leaving_no_namespace(&[&["bench", "reconnect", "--json"], args].concat(), "rc"))
}

/// `shoal-lab ARGS`'s output, once checked that it removed the namespaces it made
/// (named `shoal-<tag>-<its pid>-…` by `shoal_testnet::Net`).
fn run_leaving_no_namespace(args: &[&str], tag: &str) -> std::process::Output {
    let child = shoal_lab()
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let prefix = format!("shoal-{tag}-{}-", child.id() % 60000);
    let out = child.wait_with_output().unwrap();
    let listed = std::process::Command::new("ip").args(["netns", "list"]).output().unwrap();
    let left = String::from_utf8_lossy(&listed.stdout).lines().filter(|l| l.starts_with(&prefix)).count();
    assert_eq!(left, 0, "the bench left {left} namespaces behind");
    out
}

#[test]
fn three_hosts_with_wifi_like_impairment_match_unsplit() {
    if !namespaces_available() {
        return;
    }
    let v = bench(&["--flaps", "0", "-n", "64", "--impair", "delay=3ms,jitter=2ms,loss=1%"]);
    assert_eq!(v["identical"], true, "{v}");
    assert_eq!(v["tokens"], 64);
}

#[test]
fn link_flaps_during_a_long_generation_change_nothing() {
    if !namespaces_available() {
        return;
    }
    let v = bench(&["--flaps", "3", "--down-secs", "3", "-n", "400"]);
    eprintln!("link up → next token (ms): {}", v["flaps"]);
    assert_eq!(v["identical"], true, "tokens or logits changed across link flaps: {v}");
    assert_eq!(v["tokens"], 400, "{v}");
    let flaps = v["flaps"].as_array().unwrap();
    assert_eq!(flaps.len(), 3);
    for f in flaps {
        let ms = f["link_up_to_next_token_ms"].as_f64().unwrap();
        assert!((0.0..60_000.0).contains(&ms), "{f}");
    }
}

/// The planner's prediction check: SmolLM2 on 2-3 namespace hosts with link delays of
/// 0, 3 and 10 ms, different splits, keep-alive off and on, predicted vs measured
/// decode tok/s. Every configuration runs, and each prediction is within 50% of its
/// run: a bound this shared 2-core machine holds (measured: +4% to +27% with a build
/// running beside it, 2026-12-06) that a planner off by its hop costs or by a unit
/// does not. The bench's own figures are in docs/benchmarks.md.
#[test]
fn planner_predictions_are_checked_against_runs() {
    if !namespaces_available() {
        return;
    }
    model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let out =
        shoal_lab().args(["bench", "plan", "--json", "--configs", "5", "-n", "48", "--rounds", "1"]).output().unwrap();
    let v = json(out);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 5, "{v}");
    let delays: Vec<u64> = rows.iter().map(|r| r["delay_ms"].as_u64().unwrap()).collect();
    assert!(delays.contains(&0) && delays.contains(&3) && delays.contains(&10), "{delays:?}");
    // Keep-alive is predicted too (its wake-up cost waived).
    assert!(rows.iter().any(|r| r["keepalive"] == true) && rows.iter().any(|r| r["keepalive"] == false), "{v}");
    eprintln!("split      delay  predicted  measured  error");
    for r in rows {
        let (p, m, e) = (
            r["predicted_tok_s"].as_f64().unwrap(),
            r["measured_tok_s"].as_f64().unwrap(),
            r["error"].as_f64().unwrap(),
        );
        eprintln!("{:<10} {:>3} ms {p:>10.2} {m:>9.2} {:>+5.1}%", r["split"].to_string(), r["delay_ms"], e * 100.0);
        assert!(p.is_finite() && p > 0.0 && m.is_finite() && m > 0.0, "{r}");
        assert!((p / m - 1.0).abs() <= 0.5 && e.abs() <= 0.5, "predicted {p:.2} tok/s against {m:.2} measured: {r}");
        assert!(r["ms_per_layer"].as_f64().unwrap() > 0.0 && r["wake_ms"].as_f64().unwrap() >= 0.0, "{r}");
    }
}

/// `shoal-lab bench replace --netns`: five plain nodes, each on a host of its own, the
/// middle stage's node SIGKILLed during a generation; the bench prints its table, the
/// generation resumes on a spare and ends as the unsplit run. The time from the kill to
/// the next token is the benchmark's figure (target p50 <= 5 s; one round took 5.15 s on
/// 2026-12-06 with a build beside it); one round here must stay within 20 s, four times
/// the target, a
/// bound only a replacement that waits on a timeout (the 60 s no-progress bound, a
/// suspicion that never ends) exceeds.
#[test]
fn bench_replace_on_namespace_hosts_resumes_and_matches_unsplit() {
    if !namespaces_available() {
        return;
    }
    model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let out = run_leaving_no_namespace(&["bench", "replace", "--netns", "--rounds", "1", "-n", "80"], "lab");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    // "round killed stage kill→token-s tokens-replayed same-answer"
    let row: Vec<&str> =
        text.lines().find(|l| l.starts_with("0 ")).expect("the round's row").split_whitespace().collect();
    assert_eq!(row.len(), 6, "{text}");
    let gap: f64 = row[3].parse().unwrap();
    assert!(gap.is_finite() && gap > 0.0 && gap <= 20.0, "kill → next token took {gap} s: {text}");
    assert!(row[4].parse::<u64>().unwrap() > 20, "the prompt and the tokens before the kill are replayed: {text}");
    assert_eq!(row[5], "true", "the answer equals the unsplit run: {text}");
    assert!(text.contains("kill → next token: p50"), "{text}");
}

/// Issue 41's fault schedule on namespace hosts: SmolLM2 at 0-9 / 9-21 / 21-30, one
/// 700-token greedy generation per seed through eight mixed faults (links cut for
/// seconds, 10% loss, SIGKILL and restart of a stage, the coordinator's too (the client
/// resumes), also while its link is down, and a stage stopped 5-20 s like a laptop's
/// lid):
/// tokens and logits digest equal the unsplit run's, so no fault ever left the ring
/// without progress for the 60 s bound (the generation fails there), and the bench
/// gives each fault its healing → next token figure. The figures themselves are the
/// bench's to print (targets: 3 s after a link is back, 5 s after a restarted stage
/// serves); here, on a shared machine, they only have to exist. Before the re-drive
/// fix, the backoff grew with each fault in a row until the next re-drive lay past the
/// 60 s bound ("no progress for 60 s ... re-drives").
#[test]
fn mixed_faults_on_namespace_hosts_never_change_the_answer() {
    if !namespaces_available() {
        return;
    }
    if !shoal_testnet::precondition::tool("nft", "--version", "nftables; scripts/setup.sh installs it") {
        return;
    }
    model("SmolLM2-135M-Instruct.Q4_1.gguf");
    // Seeds whose schedules hold every kind of fault between them, the coordinator's
    // restart (seed 7) included.
    let out = run_leaving_no_namespace(&["bench", "faults", "--json", "--seeds", "1,3,7"], "flt");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&text).unwrap();
    eprintln!("{}", serde_json::to_string_pretty(&v).unwrap());
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3, "{v}");
    for r in runs {
        assert_eq!(r["identical"], true, "seed {}: {r}", r["seed"]);
        assert_eq!(r["tokens"], 700, "{r}");
        let faults = r["faults"].as_array().unwrap();
        assert!(faults.len() >= 3, "seed {}: only {} faults hit the generation: {r}", r["seed"], faults.len());
        for f in faults {
            // Healed → next token, or null where the generation ended first.
            let t = &f[2];
            assert!(t.is_null() || t.as_f64().is_some_and(|t| (0.0..600.0).contains(&t)), "seed {}: {f}", r["seed"]);
        }
    }
    let kinds = v["healed_to_next_token"].as_object().unwrap();
    for kind in ["10% loss", "link cut", "restart", "restart, link down", "lid closed", "coordinator restart"] {
        assert!(kinds[kind]["n"].as_u64().is_some_and(|n| n > 0), "no {kind} figure: {v}");
    }
}

/// `shoal-lab bench soak`, a few minutes of it: four plain `shoal serve` nodes on
/// namespace hosts (the model placed by the leader), a client streaming through every
/// node's own API, and one fault at a time from a seeded schedule (WiFi drops, loss
/// bursts, lids, crashes with the leader's, renumbered hosts). No answer may differ
/// from the one given before any fault, and no request may fail, but those whose own
/// API node was killed under them (no server can finish those). The stall figures are
/// the bench's to print (the hour-long run is pasted in docs/benchmarks.md); here they
/// only have to exist and be sane.
#[test]
fn a_short_soak_through_the_api_changes_no_answer_and_fails_no_request() {
    if !namespaces_available() {
        return;
    }
    if !shoal_testnet::precondition::tool("nft", "--version", "nftables; scripts/setup.sh installs it") {
        return;
    }
    model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let out =
        run_leaving_no_namespace(&["bench", "soak", "--json", "--hours", "0.03", "--gap-s", "4", "--seed", "3"], "lab");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&text).unwrap();
    eprintln!("{}", serde_json::to_string_pretty(&v).unwrap());
    assert_eq!(v["answers_changed"], 0, "{v}");
    assert_eq!(v["requests_failed"], 0, "{v}");
    assert!(v["requests"].as_u64().is_some_and(|n| n >= 8), "too few requests to say anything: {v}");
    assert!(v["tokens"].as_u64().is_some_and(|n| n >= 400), "{v}");
    let faults = v["faults"].as_array().unwrap();
    assert!(faults.len() >= 5, "only {} faults: {v}", faults.len());
    let kinds: std::collections::BTreeSet<&str> = faults.iter().filter_map(|f| f["kind"].as_str()).collect();
    assert!(kinds.len() >= 3, "the schedule should mix kinds: {kinds:?}");
    for f in faults {
        let t = &f["heal_to_token_max_s"];
        assert!(t.is_null() || t.as_f64().is_some_and(|t| (0.0..120.0).contains(&t)), "{f}");
    }
    let longest = v["longest_stall_s"].as_f64().unwrap();
    assert!((0.0..120.0).contains(&longest), "{v}");
}
