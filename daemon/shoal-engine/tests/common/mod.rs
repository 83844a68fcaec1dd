//! Helpers the engine's real-model tests share: the test models, and a stage's output
//! taken apart.
#![allow(dead_code)]

use shoal_types::StageOutput;
use std::path::PathBuf;

/// A test model from the models directory (`scripts/setup.sh` downloads them).
pub fn model(file: &str) -> PathBuf {
    let p = shoal_gguf::models_dir().join(file);
    assert!(p.exists(), "test model {} is missing: run scripts/setup.sh (or set SHOAL_MODELS)", p.display());
    p
}

/// The hidden states of a non-tail stage's output.
pub fn hidden(o: StageOutput) -> Vec<f32> {
    match o {
        StageOutput::Hidden(h) => h,
        StageOutput::Logits(_) => panic!("expected hidden states"),
    }
}

/// The logits of the tail's output.
pub fn logits(o: StageOutput) -> Vec<f32> {
    match o {
        StageOutput::Logits(l) => l,
        StageOutput::Hidden(_) => panic!("expected logits"),
    }
}
