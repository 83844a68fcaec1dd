//! Data-driven planner tests: each `tests/cases/*.toml` is a cluster profile plus a
//! `[case]` table with the options and what the planner must answer (the placement,
//! or an error, and sentences its explanation must contain).

use shoal_planner::plan::parse_stages;
use shoal_planner::{plan, ModelSpec, Options, Profile};

#[derive(serde::Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Case {
    /// Pins, as "FIRST-LAST:DEVICE,…".
    #[serde(default)]
    pins: String,
    #[serde(default)]
    exclude: Vec<String>,
    /// The placement expected, as "FIRST-LAST:DEVICE,…".
    expect_stages: Option<String>,
    /// Hosts expected to be offered as replicas.
    #[serde(default)]
    expect_replicas: Vec<String>,
    /// A substring of the error expected instead of a plan.
    expect_error: Option<String>,
    /// Substrings the explanation must contain.
    #[serde(default)]
    expect_explanation: Vec<String>,
}

fn run_case(path: &std::path::Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let mut doc: toml::Table = toml::from_str(&text).map_err(|e| e.to_string())?;
    let case: Case = doc.remove("case").ok_or("no [case] table")?.try_into().map_err(|e| format!("[case]: {e}"))?;
    let profile = Profile::parse(&toml::to_string(&doc).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let ModelSpec::Given(model) = profile.model else { return Err("cases give model sizes".into()) };
    let mut opts = Options::default();
    if let Some(c) = profile.context {
        opts.sizing.context = c;
    }
    opts.pins = parse_stages(&case.pins).map_err(|e| e.to_string())?;
    opts.exclude = case.exclude.clone();
    let result = plan(&model, &profile.cluster, &opts);
    match (&case.expect_error, result) {
        (Some(want), Err(e)) => {
            let e = e.to_string();
            if !e.contains(want.as_str()) {
                return Err(format!("error {e:?} does not contain {want:?}"));
            }
        }
        (Some(want), Ok(p)) => return Err(format!("expected an error ({want:?}), got a plan: {p:#?}")),
        (None, Err(e)) => return Err(format!("expected a plan, got: {e}")),
        (None, Ok(p)) => {
            let got: Vec<String> = p.stages.iter().map(|s| format!("{}-{}:{}", s.first, s.last, s.device)).collect();
            let got = got.join(",");
            if let Some(want) = &case.expect_stages {
                if &got != want {
                    return Err(format!("placement {got}, expected {want}\n{:#?}", p.explanation));
                }
            }
            let replicas: Vec<String> = p.replicas.iter().map(|r| r.host.clone()).collect();
            let mut want_r = case.expect_replicas.clone();
            want_r.sort();
            let mut got_r = replicas.clone();
            got_r.sort();
            if got_r != want_r {
                return Err(format!("replicas {replicas:?}, expected {:?}", case.expect_replicas));
            }
            let text = p.explanation.join("\n");
            for want in &case.expect_explanation {
                if !text.contains(want.as_str()) {
                    return Err(format!("explanation lacks {want:?}:\n{text}"));
                }
            }
            assert!(p.fits && p.predicted_tok_s > 0.0 && p.predicted_ttft_s > 0.0, "{p:#?}");
        }
    }
    Ok(())
}

#[test]
fn every_case_gets_its_expected_answer() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cases");
    let mut paths: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    paths.sort();
    assert!(paths.len() >= 8, "cases missing in {}", dir.display());
    let failures: Vec<String> = paths
        .iter()
        .filter_map(|p| run_case(p).err().map(|e| format!("{}: {e}", p.file_name().unwrap().to_string_lossy())))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
