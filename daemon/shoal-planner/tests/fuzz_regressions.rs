//! Inputs of the `profile` fuzz target (daemon/fuzz), replayed on stable: the seeds
//! and every input a fuzz run found, each fixed at its root.

use shoal_planner::Profile;
use std::path::{Path, PathBuf};

/// Every kept input of fuzz target `target`: its seeds (at least one) and the inputs
/// its runs found (`daemon/fuzz/regressions/<target>/`, absent until one is found).
fn kept_inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut out = Vec::new();
    for dir in ["seeds", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) else { continue };
        for e in entries {
            let path = e.expect("a readable directory entry").path();
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.push((path, bytes));
        }
    }
    assert!(out.iter().any(|(p, _)| p.components().any(|c| c.as_os_str() == "seeds")), "no seeds for {target}");
    out.sort();
    out
}

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
