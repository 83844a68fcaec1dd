//! The Linux package and service, as a user meets them. The `.deb` (built by cargo-deb
//! from this build's binary) goes into a clean Debian 12 root made by debootstrap
//! (`scripts/setup.sh` caches it): files in place, the unit passes `systemd-analyze
//! verify`, the `shoal` user exists, `shoal --version` runs there. An upgrade to the
//! next package version keeps a node's key and cluster (the data of a Shoal 0.1.0
//! member, `tests/data/node-0.1.0`). Then the root boots under a real systemd
//! (`systemd-nspawn --boot`): the service starts as `shoal`, reports ready, answers
//! `/health`, is restarted after SIGKILL, and stops in time. `remove` keeps
//! /var/lib/shoal, `purge` deletes it. And `shoal service install` (and
//! `packaging/linux/install.sh`, which runs it) writes the packaged unit, and stages
//! the packaged launchd daemon for macOS. Needs root, debootstrap's root, systemd-nspawn and cargo-deb (the setup
//! installs them); without them the package test says it skipped, and why.

mod common;
use common::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const ALPHA: &str = "89fb2d9251a38c3c4ab215dffebe175e400e9335f2e546548255881684dd02c6";
const CLUSTER: &str = "6977271b4e67bb8451a1681aab587991";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn packaged_unit() -> String {
    std::fs::read_to_string(workspace().join("packaging/linux/shoal.service")).unwrap()
}

fn chroot(root: &Path, args: &[&str]) -> String {
    sh(Command::new("chroot").arg(root).args(args).env("DEBIAN_FRONTEND", "noninteractive"))
}

/// Why the package test cannot run here, if it cannot.
fn missing() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root (chroot, dpkg in a root, systemd-nspawn)".into());
    }
    for tool in ["debootstrap", "systemd-nspawn", "dpkg-deb"] {
        if Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().map_or(true, |o| !o.status.success())
        {
            return Some(format!("{tool} is not installed (scripts/setup.sh installs it)"));
        }
    }
    if Command::new("cargo").args(["deb", "--version"]).output().map_or(true, |o| !o.status.success()) {
        return Some("cargo-deb is not installed (scripts/setup.sh installs it)".into());
    }
    if !debroot().exists() {
        return Some(format!("no Debian root at {} (scripts/setup.sh makes it)", debroot().display()));
    }
    None
}

fn debroot() -> PathBuf {
    PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/shoal/debroot/current.tar")
}

/// The .deb of this build's binary (the test profile's, stripped by cargo-deb), as
/// package version `version`.
fn build_deb(out: &Path, version: &str) -> PathBuf {
    let deb = out.join(format!("shoal_{version}_amd64.deb"));
    sh(Command::new("cargo")
        .current_dir(workspace())
        .args(["deb", "-p", "shoal", "--no-build", "--profile", "dev", "--fast", "--quiet"])
        .args(["--deb-version", version, "-o"])
        .arg(&deb));
    deb
}

/// `key=value` lines.
fn fields(text: &str) -> HashMap<String, String> {
    text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn the_deb_installs_runs_under_systemd_upgrades_keeping_the_node_and_removes_cleanly() {
    if let Some(why) = missing() {
        return shoal_testnet::precondition::skip(&why);
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    sh(Command::new("tar").arg("-C").arg(&root).arg("-xf").arg(debroot()));
    let v1 = build_deb(tmp.path(), "0.1.0-1");
    let v2 = build_deb(tmp.path(), "0.1.0-2");
    for deb in [&v1, &v2] {
        std::fs::copy(deb, root.join("tmp").join(deb.file_name().unwrap())).unwrap();
    }

    // Install: files, unit, user, data directory, the binary runs.
    chroot(&root, &["dpkg", "-i", "/tmp/shoal_0.1.0-1_amd64.deb"]);
    assert!(root.join("usr/bin/shoal").is_file());
    assert_eq!(std::fs::read_to_string(root.join("usr/lib/systemd/system/shoal.service")).unwrap(), packaged_unit());
    let wants = root.join("etc/systemd/system/multi-user.target.wants/shoal.service");
    assert!(wants.symlink_metadata().is_ok(), "the service is not enabled");
    chroot(&root, &["systemd-analyze", "verify", "shoal.service"]);
    let user = chroot(&root, &["getent", "passwd", "shoal"]);
    assert!(user.contains(":/var/lib/shoal:"), "{user}");
    let groups = chroot(&root, &["id", "-nG", "shoal"]);
    assert!(groups.split_whitespace().any(|g| g == "video"), "shoal is not in the GPU groups: {groups}");
    let data = chroot(&root, &["stat", "-c", "%U %a", "/var/lib/shoal"]);
    assert_eq!(data.trim(), "shoal 750");
    let version = chroot(&root, &["shoal", "--version"]);
    assert!(version.starts_with(&format!("shoal {}", env!("CARGO_PKG_VERSION"))), "{version}");
    assert!(version.contains("commit ") && version.contains("backends: cpu"), "{version}");

    // A member of a cluster, as Shoal 0.1.0 left it; then the upgrade.
    let data = root.join("var/lib/shoal");
    let old = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/node-0.1.0");
    sh(Command::new("cp").arg("-r").arg(old.join("node.key")).arg(old.join("state.sled")).arg(&data));
    chroot(&root, &["chown", "-R", "shoal:shoal", "/var/lib/shoal"]);
    chroot(&root, &["chmod", "600", "/var/lib/shoal/node.key"]);
    let key_before = std::fs::read(data.join("node.key")).unwrap();
    chroot(&root, &["dpkg", "-i", "/tmp/shoal_0.1.0-2_amd64.deb"]);
    assert_eq!(chroot(&root, &["dpkg-query", "-W", "-f", "${Version}", "shoal"]), "0.1.0-2");
    assert_eq!(std::fs::read(data.join("node.key")).unwrap(), key_before, "the upgrade changed the node's key");

    // Under systemd: a check unit runs once the system is up, then powers off.
    std::fs::copy(workspace().join("packaging/linux/check-in-container.sh"), root.join("usr/local/sbin/shoal-check"))
        .unwrap();
    std::fs::write(
        root.join("etc/systemd/system/shoal-check.service"),
        "[Unit]\nAfter=multi-user.target\n[Service]\nType=oneshot\nExecStart=/usr/local/sbin/shoal-check\n\
         [Install]\nWantedBy=multi-user.target\n",
    )
    .unwrap();
    chroot(&root, &["systemctl", "enable", "shoal-check.service"]);
    let boot = Command::new("timeout")
        .args(["180", "systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--private-network", "-D"])
        .arg(&root)
        .arg("--boot")
        .output()
        .unwrap();
    let log = std::fs::read_to_string(root.join("var/log/shoal-check")).unwrap_or_else(|e| {
        panic!(
            "the check did not run under systemd-nspawn ({e}; {}):\n{}",
            boot.status,
            String::from_utf8_lossy(&boot.stdout)
        )
    });
    eprintln!("inside the container:\n{log}");
    let f = fields(&log);
    assert!(log.lines().any(|l| l == "done"), "the check did not finish:\n{log}");
    assert_eq!(f["active"], "active", "{log}");
    assert_eq!(f["user"], "shoal", "the node does not run as the shoal user: {log}");
    assert!(f["status"].starts_with(&format!("node {ALPHA} serving")), "not ready (sd_notify): {log}");
    for h in ["health1", "health2"] {
        // 503 until a model is loaded: /health answers either way.
        let code = f[h].strip_prefix("HTTP/1.").and_then(|l| l.get(2..5));
        assert!(matches!(code, Some("200" | "503")), "{h}: {log}");
    }
    // The upgraded node is the same member of the same cluster.
    let status: serde_json::Value = serde_json::from_str(&f["cluster"]).unwrap_or_else(|e| panic!("{e}: {log}"));
    assert_eq!(status["node"], ALPHA, "{log}");
    assert_eq!(status["cluster"], CLUSTER, "{log}");
    assert_eq!(status["members"].as_array().map(Vec::len), Some(2), "{log}");
    // SIGKILL: systemd started it again.
    assert_ne!(f["pid1"], f["pid2"], "{log}");
    assert_ne!(f["pid2"], "0", "{log}");
    assert!(f["restarts"].parse::<u32>().unwrap() >= 1, "{log}");
    assert_eq!(f["watchdog_usec"], "30s", "{log}");
    assert_ne!(f["watchdog_ping"], "0", "the node never pinged the watchdog: {log}");
    assert_eq!(f["result"], "success", "{log}");
    let stop_ms: u64 = f["stop_ms"].parse().unwrap();
    assert!(stop_ms < 15_000, "systemd had to kill the node: {log}");

    // remove keeps the node's data; purge deletes it.
    chroot(&root, &["systemctl", "disable", "shoal-check.service"]);
    chroot(&root, &["dpkg", "-r", "shoal"]);
    assert!(!root.join("usr/bin/shoal").exists());
    assert!(!root.join("usr/lib/systemd/system/shoal.service").exists());
    assert_eq!(std::fs::read(data.join("node.key")).unwrap(), key_before, "remove lost the node's key");
    chroot(&root, &["dpkg", "-P", "shoal"]);
    assert!(!data.exists(), "purge left /var/lib/shoal");
}

#[test]
fn service_install_writes_the_packaged_unit_and_the_join_token() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let token = "shoal-join-6977271b4e67bb8451a1681aab587991-25839269-628d4f1059f61552d43328be78d00786";
    // A bad token is refused before anything is written.
    let out = shoal().args(["service", "install", "--root"]).arg(root).args(["--join", "1234"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--join"), "{out:?}");
    assert_eq!(std::fs::read_dir(root).unwrap().count(), 0, "a refused install wrote files");

    let out = shoal().args(["service", "install", "--root"]).arg(root).args(["--join", token]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    // The packaged unit, running the binary where it was put.
    let unit = std::fs::read_to_string(root.join("etc/systemd/system/shoal.service")).unwrap();
    assert_eq!(unit, packaged_unit().replace("ExecStart=/usr/bin/shoal ", "ExecStart=/usr/local/bin/shoal "));
    assert_eq!(unit.lines().filter(|l| l.starts_with("ExecStart=")).count(), 1);
    let bin = root.join("usr/local/bin/shoal");
    assert_eq!(std::fs::read(&bin).unwrap(), std::fs::read(env!("CARGO_BIN_EXE_shoal")).unwrap());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&bin).unwrap().permissions().mode() & 0o777, 0o755);
    let file = root.join("var/lib/shoal/join-token");
    assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), token);
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600, "the token is a secret");

    // packaging/linux/install.sh (other systemd distributions) writes the same.
    let other = tempfile::tempdir().unwrap();
    let out = Command::new(workspace().join("packaging/linux/install.sh"))
        .args(["--join", token, "--root"])
        .arg(other.path())
        .arg(env!("CARGO_BIN_EXE_shoal"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    for file in ["etc/systemd/system/shoal.service", "var/lib/shoal/join-token", "usr/local/bin/shoal"] {
        assert_eq!(std::fs::read(other.path().join(file)).unwrap(), std::fs::read(root.join(file)).unwrap(), "{file}");
    }

    // Uninstall removes what install wrote and keeps the data, unless purged.
    let out = shoal().args(["service", "uninstall", "--root"]).arg(root).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(!root.join("etc/systemd/system/shoal.service").exists() && !bin.exists());
    assert!(file.exists());
    let out = shoal().args(["service", "uninstall", "--purge", "--root"]).arg(root).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(!root.join("var/lib/shoal").exists());
}

#[test]
fn service_install_stages_the_packaged_launchd_daemon() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let token = "shoal-join-6977271b4e67bb8451a1681aab587991-25839269-628d4f1059f61552d43328be78d00786";
    let out = shoal()
        .args(["service", "install", "--manager", "launchd", "--root"])
        .arg(root)
        .args(["--join", token])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let packaged = workspace().join("packaging/macos/dev.shoal.node.plist");
    // The packaged daemon runs /usr/local/bin/shoal, where install puts the binary.
    assert_eq!(
        std::fs::read(root.join("Library/LaunchDaemons/dev.shoal.node.plist")).unwrap(),
        std::fs::read(&packaged).unwrap()
    );
    assert_eq!(
        std::fs::read(root.join("usr/local/bin/shoal")).unwrap(),
        std::fs::read(env!("CARGO_BIN_EXE_shoal")).unwrap()
    );
    let data = root.join("Library/Application Support/Shoal");
    assert_eq!(std::fs::read_to_string(data.join("join-token")).unwrap().trim(), token);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&data).unwrap().permissions().mode() & 0o777, 0o700);
    // launchd reads it as a property list with the keys that make it a boot daemon.
    let script = "import plistlib, sys; p = plistlib.load(open(sys.argv[1], 'rb')); \
                  print(p['Label'], p['RunAtLoad'], p['KeepAlive']['SuccessfulExit'], p['ProcessType'], \
                  p['ProgramArguments'][0])";
    let parsed = Command::new("python3").args(["-c", script]).arg(&packaged).output().unwrap();
    assert!(parsed.status.success(), "{parsed:?}");
    assert_eq!(
        String::from_utf8_lossy(&parsed.stdout).trim(),
        "dev.shoal.node True False Background /usr/local/bin/shoal"
    );
    // And removed again.
    let out =
        shoal().args(["service", "uninstall", "--manager", "launchd", "--purge", "--root"]).arg(root).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(!root.join("Library/LaunchDaemons/dev.shoal.node.plist").exists() && !data.exists());
}
