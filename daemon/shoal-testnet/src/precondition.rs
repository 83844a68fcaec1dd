//! What a test does when something it needs is missing here (root, network namespaces,
//! a tool, a standard library): one rule for the whole suite, so that a summary line
//! never counts a test that did not run as one that passed.
//!
//! - Under `CI=true` (`.ci/run`): the test fails, saying what to install.
//! - Else with `SHOAL_ALLOW_SKIP=1` (`scripts/test.sh` sets it outside CI): the test is
//!   skipped: it returns, and its name and reason are appended to the file named by
//!   `SHOAL_SKIP_LOG`, which `scripts/test.sh` prints beside its summary.
//! - Else (a bare `cargo test`): the test fails, saying how to allow the skip.

use std::io::Write;

/// Skip the calling test because `why` (what is missing and what provides it), or fail
/// it, by the rule above. Returns only when the skip is allowed: the caller returns.
#[track_caller]
pub fn skip(why: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        panic!("{test} cannot run here: {why} (a missing precondition fails the test under CI=true)");
    }
    if std::env::var_os("SHOAL_ALLOW_SKIP").is_none_or(|v| v != "1") {
        panic!("{test} cannot run here: {why}; set SHOAL_ALLOW_SKIP=1 to skip it instead (scripts/test.sh does)");
    }
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|stem| stem.rsplit_once('-').map_or(stem.clone(), |(name, _hash)| name.to_string()))
        .unwrap_or_default();
    eprintln!("SKIPPED {binary}::{test}: {why}");
    if let Some(log) = std::env::var_os("SHOAL_SKIP_LOG") {
        // One line per skip, appended whole: the suite's binaries run one at a time, a
        // binary's tests two at a time.
        let line = format!("{binary}::{test}: {}\n", why.replace('\n', " "));
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// Host namespaces for a test, or the skip rule's verdict: `None` means the caller
/// returns (skipped).
pub fn namespaces(prefix: &str, hosts: usize) -> Option<crate::Net> {
    match crate::Net::new(prefix, hosts) {
        Ok(net) => Some(net),
        Err(e) => {
            skip(&format!("network namespaces cannot be made (they need root and iproute2): {e}"));
            None
        }
    }
}

/// Whether `tool` runs here (`tool ARG` exits 0); else the skip rule's verdict with
/// `install` (what provides it) and `false`.
pub fn tool(tool: &str, arg: &str, install: &str) -> bool {
    let ok = std::process::Command::new(tool).arg(arg).output().is_ok_and(|o| o.status.success());
    if !ok {
        skip(&format!("{tool} is not installed ({install})"));
    }
    ok
}
