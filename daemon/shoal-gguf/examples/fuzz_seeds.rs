//! Writes seed inputs for the GGUF fuzz target (see daemon/fuzz/README.md): small
//! synthetic models built by the same helper the tests use, into daemon/fuzz/seeds/gguf.

#[path = "../tests/common/mod.rs"]
mod common;

fn main() -> std::io::Result<()> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/gguf");
    std::fs::create_dir_all(&dir)?;
    for (i, (layers, tied)) in [(1, true), (2, false), (3, true)].into_iter().enumerate() {
        let mut b = common::synthetic_model(layers, tied);
        // Keep seeds small: the header and a little data.
        b.truncate(b.len().min(8192));
        std::fs::write(dir.join(format!("seed-{i}")), b)?;
    }
    println!("seeds written to {}", dir.display());
    Ok(())
}
