//! Records the git commit the binary is built from (`shoal --version`): from
//! `SHOAL_GIT_COMMIT` when set (builds from a source tarball, packaging scripts), else
//! from `git`, else "unknown".

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=SHOAL_GIT_COMMIT");
    let commit = std::env::var("SHOAL_GIT_COMMIT").ok().filter(|c| !c.trim().is_empty()).or_else(git_commit);
    println!("cargo:rustc-env=SHOAL_GIT_COMMIT={}", commit.as_deref().map(str::trim).unwrap_or("unknown"));
}

/// The commit of the checkout, with `-dirty` when tracked files differ from it; and
/// rerun triggers for when it moves (HEAD, the branch it names, packed refs).
fn git_commit() -> Option<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let git_dir = Command::new("git").arg("-C").arg(&root).args(["rev-parse", "--git-dir"]).output().ok()?;
    if !git_dir.status.success() {
        return None;
    }
    let git_dir = root.join(String::from_utf8_lossy(&git_dir.stdout).trim());
    println!("cargo:rerun-if-changed={}", git_dir.join("HEAD").display());
    println!("cargo:rerun-if-changed={}", git_dir.join("packed-refs").display());
    if let Ok(head) = std::fs::read_to_string(git_dir.join("HEAD")) {
        if let Some(reference) = head.trim().strip_prefix("ref: ") {
            println!("cargo:rerun-if-changed={}", git_dir.join(reference).display());
        }
    }
    let out = Command::new("git").arg("-C").arg(&root).args(["rev-parse", "--short=12", "HEAD"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let mut commit = String::from_utf8_lossy(&out.stdout).trim().to_string();
    // Checked when the crate builds (not on every edit): a tree changed after that shows
    // the commit only, which is what a release build from a clean checkout records.
    let dirty = Command::new("git")
        .arg("-C")
        .arg(&root)
        .args(["diff", "--quiet", "HEAD", "--"])
        .status()
        .is_ok_and(|s| s.code() == Some(1));
    if dirty {
        commit.push_str("-dirty");
    }
    Some(commit)
}
