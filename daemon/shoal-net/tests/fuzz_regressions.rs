//! Inputs of the `frame` and `txt` fuzz targets (daemon/fuzz), replayed on stable: the
//! seeds and every input a fuzz run found, each fixed at its root.

use shoal_net::{Advert, Frame, FrameLimits};
use shoal_testnet::fuzz_inputs::{is_seed, kept_inputs};

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
