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

/// The `control` target's inputs: two bytes of context size, then a control request as
/// a client sends it. Seeds are valid requests; found inputs are refused or in bounds.
#[test]
fn kept_control_inputs_are_checked_or_refused() {
    use shoal_pipeline::protocol::sampling_params;
    use shoal_pipeline::ControlRequest;
    for (path, bytes) in kept_inputs("control") {
        eprintln!("replaying {}", path.display());
        let Some((ctx, body)) = bytes.split_first_chunk::<2>() else { continue };
        let n_ctx = u32::from(u16::from_le_bytes(*ctx));
        let request = serde_json::from_slice::<ControlRequest>(body);
        if let Ok(ControlRequest::Generate(req)) = &request {
            if let Ok(params) = req.validate(n_ctx) {
                assert!((0..=65536).contains(&params.repeat_last_n));
                assert!(req.prompt.len() as u64 + u64::from(req.max_new) <= u64::from(n_ctx));
            } else {
                assert!(!shoal_testnet::fuzz_inputs::is_seed(&path), "seed {} refused", path.display());
            }
        }
        if shoal_testnet::fuzz_inputs::is_seed(&path) {
            assert!(request.is_ok(), "seed {} does not decode: {:?}", path.display(), request.err());
        }
        if let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) {
            let _ = sampling_params(&value);
        }
    }
}
