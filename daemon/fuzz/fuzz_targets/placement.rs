//! Fuzz target: any text given to the placement parser gives a placement or an error,
//! never a panic; the accessors a stage uses on a parsed placement do not panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_pipeline::Placement;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(p) = Placement::parse(text, Path::new("/etc/shoal/placement.toml")) {
        assert!(!p.stages.is_empty());
        let _ = p.n_layer();
        for node in p.trusted() {
            let _ = p.stage_of(node);
        }
        for i in 0..p.stages.len() {
            let _ = p.next(i);
            let _ = p.prev(i);
        }
    }
});
