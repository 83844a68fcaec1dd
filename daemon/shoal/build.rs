//! Records the git commit the binary is built from (`shoal --version`): from
//! `SHOAL_GIT_COMMIT` when set (builds from a source tarball, packaging scripts), else
//! from `git`, else "unknown".

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=SHOAL_GIT_COMMIT");
    let commit = std::env::var("SHOAL_GIT_COMMIT").ok().filter(|c| !c.trim().is_empty()).or_else(git_commit);
    println!("cargo:rustc-env=SHOAL_GIT_COMMIT={}", commit.as_deref().map(str::trim).unwrap_or("unknown"));
    // Windows with MinGW (packaging/windows/cross-build.sh): llama.cpp's CMake names
    // ggml's static libraries without the `lib` prefix there (ggml.a, …), so
    // llama-cpp-sys-2, which looks for lib*.a, does not link them. Name them here, in
    // dependency order; link arguments come after the crates' libraries.
    if std::env::var("TARGET").is_ok_and(|t| t.ends_with("windows-gnu")) {
        for lib in ["ggml", "ggml-cpu", "ggml-base"] {
            println!("cargo:rustc-link-arg-bins=-l:{lib}.a");
        }
        // And what they need, again after them (rustc links without the default libraries).
        for lib in ["stdc++", "gomp", "pthread", "mingwex", "msvcrt", "kernel32", "advapi32", "ws2_32"] {
            println!("cargo:rustc-link-arg-bins=-l{lib}");
        }
        // MinGW's C++ and OpenMP runtimes linked in, so shoal.exe runs alone (no
        // libstdc++-6.dll or libgomp-1.dll beside it): llama-cpp-sys-2 asks for them as
        // dynamic libraries, and the linker takes the first directory holding a match,
        // so a directory with only their static archives, searched first, wins.
        static_runtime();
    }
}

/// Put MinGW's static libstdc++ and libgomp in a directory of their own, searched
/// before the compiler's (where the import libraries for their DLLs are).
fn static_runtime() {
    let Ok(out) = std::env::var("OUT_DIR") else { return };
    let dir = Path::new(&out).join("static-runtime");
    let _ = std::fs::create_dir_all(&dir);
    let cxx = std::env::var("CXX_x86_64_pc_windows_gnu").unwrap_or_else(|_| "x86_64-w64-mingw32-g++-posix".into());
    // (name looked up, name given): the threads library is asked for as pthread too.
    let libs = [
        ("libstdc++.a", "libstdc++.a"),
        ("libgomp.a", "libgomp.a"),
        ("libwinpthread.a", "libwinpthread.a"),
        ("libwinpthread.a", "libpthread.a"),
    ];
    for (lib, name) in libs {
        let Ok(found) = Command::new(&cxx).arg(format!("-print-file-name={lib}")).output() else { continue };
        let found = String::from_utf8_lossy(&found.stdout).trim().to_string();
        // Without the toolchain the compiler prints the bare name back: nothing to copy.
        if Path::new(&found).is_absolute() && std::fs::copy(&found, dir.join(name)).is_err() {
            println!("cargo:warning=could not copy {found}: shoal.exe will need {lib}'s DLL beside it");
        }
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
}

/// The commit of the checkout, with `-dirty` when tracked files differ from it; and
/// rerun triggers for when it moves (HEAD, the branch it names, packed refs: those
/// that exist).
fn git_commit() -> Option<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let git_dir = Command::new("git").arg("-C").arg(&root).args(["rev-parse", "--git-dir"]).output().ok()?;
    if !git_dir.status.success() {
        return None;
    }
    let git_dir = root.join(String::from_utf8_lossy(&git_dir.stdout).trim());
    let mut watched = vec![git_dir.join("HEAD"), git_dir.join("packed-refs")];
    if let Ok(head) = std::fs::read_to_string(git_dir.join("HEAD")) {
        if let Some(reference) = head.trim().strip_prefix("ref: ") {
            let reference = git_dir.join(reference);
            // A branch without a commit yet (or packed): its folder sees the ref appear.
            match reference.exists() {
                true => watched.push(reference),
                false => watched.extend(reference.parent().map(Path::to_path_buf)),
            }
        }
    }
    // Only paths that exist: Cargo takes a listed path that is missing (packed-refs in a
    // fresh `git init`, a branch whose ref sits only in packed-refs) as changed on every
    // build, which reran this script and relinked both binaries each time. A branch
    // packed later deletes its ref file, and a ref created later rewrites packed-refs
    // or HEAD's ref, so the paths that exist still see the commit move.
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
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
