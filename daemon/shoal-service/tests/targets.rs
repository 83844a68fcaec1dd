//! The service code of the other platforms builds: this crate type-checks for Windows
//! (the Service Control Manager, through `windows-service`) and macOS (launchd), where
//! their standard libraries are installed (`rustup target add`; `scripts/setup.sh`
//! tries). It cannot run here; this is what keeps it from rotting unseen. It runs on
//! Linux (as CI does); checked for the other targets, this file is empty.
#![cfg(target_os = "linux")]

use std::path::Path;
use std::process::Command;

fn installed(target: &str) -> bool {
    Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == target))
}

fn check(target: &str) {
    if !installed(target) {
        return shoal_testnet::precondition::skip(&format!(
            "the {target} standard library is not installed (rustup target add {target}; scripts/setup.sh tries)"
        ));
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // A target directory of its own: the suite's cargo holds the usual one.
    let out = Command::new(env!("CARGO"))
        .current_dir(&workspace)
        .args(["check", "--quiet", "--locked", "-p", "shoal-service", "--all-targets", "--target", target])
        .arg("--target-dir")
        .arg(workspace.join("target/cross-check"))
        // Warnings there are code that rots unseen too.
        .env("RUSTFLAGS", "-D warnings")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "shoal-service does not build for {target}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn builds_for_windows() {
    check("x86_64-pc-windows-gnu");
}

#[test]
fn builds_for_macos() {
    check("x86_64-apple-darwin");
}

/// Security review F5: the installer's data folder (the node's key) is locked to the
/// service and administrators, as `shoal service install` locks it, with access-list
/// entries that replace ProgramData's (whose Users entries would let any local user
/// read the key). Checked on the installer's source here; building and installing the
/// .msi needs Windows and WiX.
#[test]
fn the_installer_locks_the_data_folder_to_the_service_and_administrators() {
    let wxs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../packaging/windows/main.wxs")).unwrap();
    let data = wxs.split("<Component Id=\"ShoalData\"").nth(1).expect("the data folder's component");
    let data = data.split("</Component>").next().unwrap();
    let perms: Vec<&str> = data.split("<Permission ").skip(1).map(|p| p.split("/>").next().unwrap()).collect();
    assert_eq!(perms.len(), 2, "{data}");
    assert!(perms[0].contains("User=\"[WIX_ACCOUNT_LOCALSYSTEM]\"") && perms[0].contains("GenericAll=\"yes\""));
    assert!(perms[1].contains("User=\"[WIX_ACCOUNT_ADMINISTRATORS]\"") && perms[1].contains("GenericAll=\"yes\""));
    for sid in ["WIX_ACCOUNT_LOCALSYSTEM", "WIX_ACCOUNT_ADMINISTRATORS"] {
        assert!(wxs.contains(&format!("<PropertyRef Id=\"{sid}\"/>")), "{sid} is not brought in");
    }
}
