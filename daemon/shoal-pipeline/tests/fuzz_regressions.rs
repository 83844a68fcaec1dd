//! Inputs of the `placement` fuzz target (daemon/fuzz), replayed on stable: the seeds
//! and every input a fuzz run found, each fixed at its root.

use shoal_pipeline::Placement;
use shoal_testnet::fuzz_inputs::kept_inputs;
use std::path::Path;

#[test]
fn kept_fuzz_inputs_parse_or_are_refused() {
    for (path, bytes) in kept_inputs("placement") {
        // Shown with a failing test's output: the input that failed is the last one.
        eprintln!("replaying {}", path.display());
        let Ok(text) = std::str::from_utf8(&bytes) else { continue };
        let parsed = Placement::parse(text, Path::new("/etc/shoal/placement.toml"));
        if let Ok(p) = &parsed {
            for i in 0..p.stages.len() {
                assert_eq!(p.stage_of(p.stages[i].node), Some(i));
                let _ = (p.next(i), p.prev(i), p.n_layer());
            }
        }
        if path.components().any(|c| c.as_os_str() == "seeds") {
            assert!(parsed.is_ok(), "seed {} does not parse: {:?}", path.display(), parsed.err());
        }
    }
}
