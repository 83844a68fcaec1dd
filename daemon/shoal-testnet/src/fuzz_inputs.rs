//! The kept inputs of the fuzz targets (`daemon/fuzz`), for the stable tests that replay
//! them: every target's seeds and every input a fuzz run found (each fixed at its root).

use std::path::{Path, PathBuf};

/// Every kept input of fuzz target `target`, sorted: its seeds (at least one, or this
/// panics) and the inputs its runs found (`daemon/fuzz/regressions/<target>/`, absent
/// until one is found).
pub fn kept_inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
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
    assert!(out.iter().any(|(p, _)| is_seed(p)), "no seeds for {target}");
    out.sort();
    out
}

/// Whether a kept input is a seed (which must parse), not a found input (which may be
/// refused).
pub fn is_seed(path: &Path) -> bool {
    path.components().any(|c| c.as_os_str() == "seeds")
}
