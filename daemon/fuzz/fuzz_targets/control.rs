//! Fuzz target: any bytes a control client sends the coordinator (a JSON
//! `ControlRequest`), and any sampling parameters an Open frame hands the tail, are
//! decoded and checked without a panic; what the checks accept is within the bounds
//! the engine relies on (the sampler never sees an out-of-range value).
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_pipeline::protocol::sampling_params;
use shoal_pipeline::ControlRequest;

fuzz_target!(|data: &[u8]| {
    // The first two bytes pick the context size the request is checked against.
    let Some((ctx, body)) = data.split_first_chunk::<2>() else { return };
    let n_ctx = u32::from(u16::from_le_bytes(*ctx));
    if let Ok(ControlRequest::Generate(req)) = serde_json::from_slice::<ControlRequest>(body) {
        if let Ok(params) = req.validate(n_ctx) {
            assert!((0..=65536).contains(&params.repeat_last_n), "repeat_last_n {} passed", params.repeat_last_n);
            assert!(!req.prompt.is_empty() && req.max_new > 0);
            assert!(req.prompt.len() as u64 + u64::from(req.max_new) <= u64::from(n_ctx));
        }
    }
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) {
        let _ = sampling_params(&value);
    }
});
