//! The hub image's root script that applies what the page asks
//! (`firmware/rootfs/usr/lib/shoal-hub/apply`), run here on folders of its own: the
//! node (an unprivileged user) writes `settings.json` and `request.json` in its inbox,
//! the script (root, on the box) must check every value before use, apply the time zone
//! and WiFi network, report in `status.json`, and handle each request once; and it
//! must never write or read through a link the node plants in its inbox, however it
//! races (security review F3). And the script that makes the box's setup code
//! (`setup-code`, review F10). The whole box is tested by `hub_image.rs` (opt-in, under
//! qemu).

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../firmware/rootfs/usr/lib/shoal-hub/apply")
}

struct Box {
    _tmp: tempfile::TempDir,
    appliance: PathBuf,
    hub: PathBuf,
    /// What the script asked of systemctl, one call a line.
    calls: PathBuf,
}

impl Box {
    fn new() -> Box {
        let tmp = tempfile::tempdir().unwrap();
        let appliance = tmp.path().join("var/lib/shoal/appliance");
        let hub = tmp.path().join("data/hub");
        // Root's folder (as the image makes it), the node's inbox in it.
        std::fs::create_dir_all(appliance.join("inbox")).unwrap();
        std::fs::create_dir_all(&hub).unwrap();
        let calls = tmp.path().join("systemctl.calls");
        let fake = tmp.path().join("systemctl");
        std::fs::write(&fake, format!("#!/bin/sh\necho \"$@\" >> {}\n", calls.display())).unwrap();
        std::process::Command::new("chmod").arg("+x").arg(&fake).status().unwrap();
        Box { _tmp: tmp, appliance, hub, calls }
    }

    /// Write `settings` and a request `id` for `action`, run the script; its status.
    fn run(&self, settings: Option<&Value>, id: &str, action: &str) -> Value {
        if let Some(s) = settings {
            std::fs::write(self.appliance.join("inbox/settings.json"), s.to_string()).unwrap();
        }
        let req = json!({"id": id, "action": action, "at": 0});
        std::fs::write(self.appliance.join("inbox/request.json"), req.to_string()).unwrap();
        let out = self.apply(&self.calls.with_file_name("systemctl"));
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        self.status()
    }

    /// Run the script on the files as they are, with `systemctl` standing for it.
    fn apply(&self, systemctl: &Path) -> std::process::Output {
        Command::new("bash")
            .arg(script())
            .env("SHOAL_HUB_APPLIANCE", &self.appliance)
            .env("SHOAL_HUB_DATA", &self.hub)
            .env("SHOAL_HUB_SYSTEMCTL", systemctl)
            .output()
            .unwrap()
    }

    fn status(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.appliance.join("status.json")).unwrap_or_default())
            .unwrap_or(Value::Null)
    }

    fn systemctl(&self) -> String {
        std::fs::read_to_string(&self.calls).unwrap_or_default()
    }

    fn iwd_files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.hub.join("iwd"))
            .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        names.sort();
        names
    }
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn tools() -> bool {
    let ok = Command::new("jq").arg("--version").output().is_ok_and(|o| o.status.success())
        && Path::new("/usr/share/zoneinfo/Europe/Paris").exists();
    if !ok {
        shoal_testnet::precondition::skip("jq or tzdata is missing (scripts/setup.sh installs them)");
    }
    ok
}

#[test]
fn apply_sets_the_time_zone_and_wifi_and_reports_each_request_once() {
    if !tools() {
        return;
    }
    let b = Box::new();
    let st = b.run(
        Some(&json!({"timezone": "Europe/Paris", "wifi": {"ssid": "Home Wi-Fi", "passphrase": "hunter2hunter2"}})),
        "00aa",
        "apply",
    );
    assert_eq!(st["request"], json!({"id": "00aa", "action": "apply", "state": "done", "message": "settings applied"}));
    assert_eq!(st["timezone"], "Europe/Paris");
    assert_eq!(st["wifi"], "Home Wi-Fi");
    // /etc/localtime on the box points at this link.
    let link = std::fs::read_link(b.hub.join("localtime")).unwrap();
    assert_eq!(link, Path::new("/usr/share/zoneinfo/Europe/Paris"));
    // iwd's file for the network: '=' and the name's bytes in hex; readable by root only.
    let name = format!("={}.psk", hex("Home Wi-Fi"));
    assert_eq!(b.iwd_files(), vec![name.clone()]);
    let psk = b.hub.join("iwd").join(&name);
    assert_eq!(std::fs::read_to_string(&psk).unwrap(), "[Security]\nPassphrase=hunter2hunter2\n");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&psk).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(b.systemctl(), "try-restart iwd.service\n");

    // The same request again (the path unit fires on every change): nothing is redone.
    std::fs::remove_file(b.hub.join("localtime")).unwrap();
    b.run(None, "00aa", "apply");
    assert!(!b.hub.join("localtime").exists(), "a request was handled twice");

    // An open network replaces the last one; no WiFi at all removes it.
    let st = b.run(Some(&json!({"timezone": "UTC", "wifi": {"ssid": "Café", "passphrase": ""}})), "00ab", "apply");
    assert_eq!(st["request"]["state"], "done", "{st}");
    assert_eq!(b.iwd_files(), vec![format!("={}.open", hex("Café"))]);
    let st = b.run(Some(&json!({"timezone": "UTC", "wifi": null})), "00ac", "apply");
    assert_eq!(st["wifi"], Value::Null, "{st}");
    assert!(b.iwd_files().is_empty());
}

#[test]
fn apply_refuses_what_the_node_should_not_ask_and_changes_nothing() {
    if !tools() {
        return;
    }
    let b = Box::new();
    b.run(Some(&json!({"timezone": "Europe/Paris", "wifi": null})), "01", "apply");
    let bad = [
        (json!({"timezone": "../../../etc/shadow"}), "not a time zone"),
        (json!({"timezone": "Europe/Atlantis"}), "not a time zone"),
        (json!({"timezone": "Europe"}), "not a time zone"),
        (json!({"wifi": {"ssid": "x", "passphrase": "short"}}), "8 to 63"),
        (json!({"wifi": {"ssid": "x", "passphrase": "pässwörd-long-enough"}}), "8 to 63"),
        // The review's F13: each line printable, the newline not, and the lines after
        // it would be sections of iwd's file.
        (json!({"wifi": {"ssid": "x", "passphrase": "abcdefgh\n[Settings]\nAutoConnect=false"}}), "8 to 63"),
        (json!({"wifi": {"ssid": "x", "passphrase": "abcdefgh\tijk"}}), "8 to 63"),
        (json!({"wifi": {"ssid": "x", "passphrase": {"not": "text"}}}), "8 to 63"),
        (json!({"wifi": {"ssid": "a\nb", "passphrase": "long enough pass"}}), "1 to 32 bytes"),
        (json!({"wifi": {"ssid": "x".repeat(33), "passphrase": "long enough pass"}}), "1 to 32 bytes"),
        (json!(["not", "an", "object"]), "not a JSON object"),
    ];
    for (i, (settings, why)) in bad.iter().enumerate() {
        let st = b.run(Some(settings), &format!("1{i}"), "apply");
        assert_eq!(st["request"]["state"], "failed", "{settings}: {st}");
        assert!(st["request"]["message"].as_str().unwrap().contains(why), "{settings}: {st}");
        assert_eq!(
            std::fs::read_link(b.hub.join("localtime")).unwrap(),
            Path::new("/usr/share/zoneinfo/Europe/Paris"),
            "{settings} changed the time zone"
        );
        assert!(b.iwd_files().is_empty(), "{settings} wrote a network");
    }
    // Requests without a valid id, or with an unknown action, do nothing but say so.
    let before = b.status();
    b.run(None, "not hex; rm -rf /", "apply");
    assert_eq!(b.status(), before);
    let st = b.run(None, "20", "format-disk");
    assert_eq!(st["request"]["state"], "failed");
    // A request file that is a link (to a file the node may not read) is not followed.
    std::fs::remove_file(b.appliance.join("inbox/request.json")).unwrap();
    let elsewhere = b.hub.join("req");
    std::fs::write(&elsewhere, json!({"id": "21", "action": "apply"}).to_string()).unwrap();
    std::os::unix::fs::symlink(&elsewhere, b.appliance.join("inbox/request.json")).unwrap();
    let out = b.apply(Path::new("false"));
    assert!(out.status.success());
    assert_ne!(b.status()["request"]["id"], "21", "a linked request was followed");
    std::fs::remove_file(b.appliance.join("inbox/request.json")).unwrap();
    // No update without a bundle; nothing rebooted.
    let st = b.run(None, "22", "update");
    assert_eq!(st["request"]["state"], "failed");
    assert!(st["request"]["message"].as_str().unwrap().contains("no update bundle"), "{st}");
    assert!(!b.systemctl().contains("reboot"), "{}", b.systemctl());
}

/// The review's F3 recipe, and more: while the script runs again and again as root, a
/// racer (the node, in its inbox) swaps every file there for links to files outside,
/// in a loop, and floods the appliance folder's names it can guess. Nothing outside
/// the inbox changes: not the files the links point to (content and mode), and no
/// request is taken from a linked file; the script refuses to run at all when the
/// appliance folder is not root's alone.
#[test]
fn links_raced_into_the_inbox_are_never_followed() {
    if !tools() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let b = Box::new();
    b.run(Some(&json!({"timezone": "Europe/Paris", "wifi": null})), "01", "apply");
    // Targets a root script must never write, chmod or read on the node's behalf.
    let victim = b.hub.join("victim");
    std::fs::write(&victim, "root's secret\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    let lure = b.hub.join("lure.json");
    std::fs::write(&lure, json!({"id": "bad", "action": "apply"}).to_string()).unwrap();
    std::fs::set_permissions(&lure, std::fs::Permissions::from_mode(0o600)).unwrap();
    let inbox = b.appliance.join("inbox");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let racer = {
        let (inbox, victim, lure, stop) = (inbox.clone(), victim.clone(), lure.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (name, to) in [("request.json", &lure), ("settings.json", &victim), ("update.raucb", &victim)] {
                    let path = inbox.join(name);
                    // A real file a moment, then a link: the swap the script must lose.
                    let _ = std::fs::remove_file(&path);
                    let _ = std::fs::write(&path, json!({"id": format!("{n:x}"), "action": "apply"}).to_string());
                    let _ = std::fs::remove_file(&path);
                    let _ = std::os::unix::fs::symlink(to, &path);
                }
                n += 1;
            }
            n
        })
    };
    for _ in 0..40 {
        b.apply(Path::new("true"));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let swaps = racer.join().unwrap();
    assert!(swaps > 40, "the racer hardly ran: {swaps} swaps");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root's secret\n", "written through a link");
    assert_eq!(std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777, 0o600, "chmod through a link");
    assert_eq!(std::fs::metadata(&lure).unwrap().permissions().mode() & 0o777, 0o600);
    assert_ne!(b.status()["request"]["id"], "bad", "a request was read through a link");
    // Nothing appeared outside the inbox but root's own files.
    let mut names: Vec<String> = std::fs::read_dir(&b.appliance)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [".taken", "inbox", "status.json"]);
    for e in std::fs::read_dir(b.appliance.join(".taken")).unwrap() {
        let meta = std::fs::symlink_metadata(e.unwrap().path()).unwrap();
        assert!(meta.is_file(), "a link kept in root's folder");
    }
    // An appliance folder others may write in: the script does nothing at all.
    std::fs::set_permissions(&b.appliance, std::fs::Permissions::from_mode(0o777)).unwrap();
    let before = b.status();
    std::fs::write(inbox.join("request.json"), json!({"id": "77", "action": "apply"}).to_string()).unwrap();
    let out = b.apply(Path::new("true"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not root's alone"));
    assert_eq!(b.status(), before);
}

/// The box's setup code (security review F10): made once, in root's folder, readable by
/// the node's group only; shown at the console's login prompt and on the boot
/// partition; a link planted in its place is replaced, never followed; nothing is done
/// in a folder others may write in.
#[test]
fn the_setup_code_is_made_once_shown_and_never_written_through_a_link() {
    use std::os::unix::fs::PermissionsExt;
    let b = Box::new();
    let (issue, esp) = (b.hub.join("issue"), b.hub.join("esp"));
    std::fs::create_dir_all(&esp).unwrap();
    let run = || {
        Command::new("bash")
            .arg(script().with_file_name("setup-code"))
            .env("SHOAL_HUB_APPLIANCE", &b.appliance)
            .env("SHOAL_HUB_ISSUE", &issue)
            .env("SHOAL_HUB_ESP", &esp)
            .env("SHOAL_HUB_GROUP", "root")
            .output()
            .unwrap()
    };
    let out = run();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let file = b.appliance.join("setup-code");
    let code = std::fs::read_to_string(&file).unwrap().trim().to_string();
    let digits: Vec<&str> = code.split('-').collect();
    assert!(
        digits.len() == 3 && digits.iter().all(|d| d.len() == 4 && d.bytes().all(|c| c.is_ascii_digit())),
        "{code}"
    );
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o640);
    assert!(std::fs::read_to_string(&issue).unwrap().contains(&code));
    assert!(std::fs::read_to_string(esp.join("SHOAL-SETUP.TXT")).unwrap().contains(&code));
    // The next boot keeps it.
    assert!(run().status.success());
    assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), code);
    // A link in its place (say, planted before root made the folder its own): replaced
    // by a new code, and what it pointed at is untouched.
    let victim = b.hub.join("victim");
    std::fs::write(&victim, "root's secret\n").unwrap();
    std::fs::remove_file(&file).unwrap();
    std::os::unix::fs::symlink(&victim, &file).unwrap();
    assert!(run().status.success());
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root's secret\n");
    assert!(std::fs::symlink_metadata(&file).unwrap().is_file());
    assert_ne!(std::fs::read_to_string(&file).unwrap().trim(), code);
    // A folder others may write in: nothing.
    std::fs::set_permissions(&b.appliance, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::remove_file(&file).unwrap();
    let out = run();
    assert!(!out.status.success());
    assert!(!file.exists());
}
