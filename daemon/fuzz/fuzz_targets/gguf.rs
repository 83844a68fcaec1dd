//! Fuzz target: any bytes given to the GGUF reader (and, when they parse, to the
//! model description) give a value or an error, never a panic, abort or huge allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    // As a whole file, and as a file whose stated length exceeds what can be read.
    for len in [data.len() as u64, data.len() as u64 + 4096] {
        if let Ok(g) = shoal_gguf::Gguf::parse(data, len, path) {
            let _ = shoal_gguf::ModelMeta::from_gguf(&g);
            let mut out = Vec::new();
            let _ = shoal_gguf::write_header(&mut out, &g.metadata, &g.tensors, g.alignment);
        }
    }
});
