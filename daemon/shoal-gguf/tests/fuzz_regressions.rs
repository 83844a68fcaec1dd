//! Inputs of the `gguf` fuzz target (daemon/fuzz), replayed on stable: the seeds and
//! every input a fuzz run found, each fixed at its root.

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

#[test]
fn kept_fuzz_inputs_parse_or_are_refused() {
    for (path, data) in kept_inputs("gguf") {
        // Shown with a failing test's output: the input that failed is the last one.
        eprintln!("replaying {}", path.display());
        // As the fuzz target: the whole file, and a file longer than what was read.
        for len in [data.len() as u64, data.len() as u64 + 4096] {
            if let Ok(g) = shoal_gguf::Gguf::parse(data.as_slice(), len, Path::new("fuzz.gguf")) {
                let _ = shoal_gguf::ModelMeta::from_gguf(&g);
                let mut out = Vec::new();
                let _ = shoal_gguf::write_header(&mut out, &g.metadata, &g.tensors, g.alignment);
            }
        }
    }
}
