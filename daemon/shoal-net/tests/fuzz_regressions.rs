//! Inputs of the `frame` and `txt` fuzz targets (daemon/fuzz), replayed on stable: the
//! seeds and every input a fuzz run found, each fixed at its root.

use shoal_net::{Advert, Frame, FrameLimits};
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

fn is_seed(path: &Path) -> bool {
    path.components().any(|c| c.as_os_str() == "seeds")
}

#[test]
fn kept_frame_inputs_decode_or_are_refused() {
    // The fuzz target's limits.
    let limits = FrameLimits { n_embd: 8, max_tokens: 16, max_message: 4096 };
    for (path, data) in kept_inputs("frame") {
        // Shown with a failing test's output: the input that failed is the last one.
        eprintln!("replaying {}", path.display());
        match Frame::decode(&data, &limits) {
            Ok(f) => assert_eq!(f.encode(), data, "{} re-encodes differently", path.display()),
            Err(e) => assert!(!is_seed(&path), "seed {} does not decode: {e}", path.display()),
        }
    }
}

#[test]
fn kept_txt_inputs_decode_or_are_refused() {
    for (path, data) in kept_inputs("txt") {
        // Shown with a failing test's output: the input that failed is the last one.
        eprintln!("replaying {}", path.display());
        let Some((port, record)) = data.split_first_chunk::<2>() else { continue };
        let port = u16::from_be_bytes(*port);
        match Advert::from_txt_record(record, port) {
            Ok(a) => assert_eq!(Advert::from_txt(&a.to_txt(), port).as_ref(), Ok(&a), "{}", path.display()),
            Err(e) => assert!(!is_seed(&path), "seed {} does not decode: {e}", path.display()),
        }
    }
}
