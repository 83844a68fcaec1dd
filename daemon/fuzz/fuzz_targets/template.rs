//! Fuzz target: a chat template from a model file (untrusted) renders within its
//! budget or fails with an error, never a crash, a hang past the harness's 10 s or an
//! allocation past its 2 GiB. Half the inputs are templates built from a small grammar
//! of nested loops, recursive macros, string doubling and repetition, `tojson` and
//! `indent` with large widths, `str.format` padding (what costs time and memory); the
//! other half raw template text (`shoal_template::fuzz::template_of`). A rendered
//! prompt is never over the output cap.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_template::{fuzz, render_json_within, Budget};

fuzz_target!(|data: &[u8]| {
    let Some(text) = fuzz::template_of(data) else { return };
    let (messages, tools) = fuzz::conversation();
    let budget = Budget::for_input(200);
    if let Ok(out) = render_json_within(&text, &messages, &tools, budget) {
        assert!(out.len() <= budget.output, "{} bytes past the cap of {}", out.len(), budget.output);
    }
});
