//! Inputs of the `template` fuzz target (daemon/fuzz), replayed on stable: the seeds
//! and every input a fuzz run found, each fixed at its root.

use shoal_template::{fuzz, render_json_within, Budget};
use shoal_testnet::fuzz_inputs::kept_inputs;

#[test]
fn kept_fuzz_inputs_render_within_the_budget_or_are_refused() {
    let (messages, tools) = fuzz::conversation();
    let budget = Budget::for_input(200);
    let mut seen = 0;
    for (path, bytes) in kept_inputs("template") {
        // Shown with a failing test's output: the input that failed is the last one.
        eprintln!("replaying {}", path.display());
        let Some(text) = fuzz::template_of(&bytes) else { continue };
        let rendered = render_json_within(&text, &messages, &tools, budget);
        if let Ok(out) = &rendered {
            assert!(out.len() <= budget.output, "{}: {} bytes", path.display(), out.len());
        }
        // The real templates among the seeds render.
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if ["chatml", "tools_json"].contains(&name) {
            assert!(rendered.is_ok(), "{}: {rendered:?}", path.display());
        }
        seen += 1;
    }
    assert!(seen >= 6, "only {seen} kept inputs: is daemon/fuzz/seeds/template there?");
}
