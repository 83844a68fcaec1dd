//! Inputs of the `profile` fuzz target (daemon/fuzz), replayed on stable: the seeds
//! and every input a fuzz run found, each fixed at its root.

use shoal_planner::Profile;
use shoal_testnet::fuzz_inputs::kept_inputs;

/// What the fuzz target checks: a profile or an error; a parsed profile validates.
fn check(text: &str) -> bool {
    match Profile::parse(text) {
        Ok(p) => {
            p.cluster.validate().expect("a parsed profile is valid");
            true
        }
        Err(_) => false,
    }
}

#[test]
fn kept_fuzz_inputs_parse_or_are_refused() {
    for (path, bytes) in kept_inputs("profile") {
        // Shown with a failing test's output: the input that failed is the last one.
        eprintln!("replaying {}", path.display());
        let Ok(text) = std::str::from_utf8(&bytes) else { continue };
        let parsed = check(text);
        if path.components().any(|c| c.as_os_str() == "seeds") {
            assert!(parsed, "seed {} does not parse", path.display());
        }
    }
}
