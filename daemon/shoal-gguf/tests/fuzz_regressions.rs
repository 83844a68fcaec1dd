//! Inputs of the `gguf` fuzz target (daemon/fuzz), replayed on stable: the seeds and
//! every input a fuzz run found, each fixed at its root.

use shoal_testnet::fuzz_inputs::kept_inputs;
use std::path::Path;

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
