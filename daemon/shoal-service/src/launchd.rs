//! launchd (macOS): the daemon definition the .pkg ships
//! (`packaging/macos/dev.shoal.node.plist`, embedded), written with the program
//! pointing at the installed binary; data in `/Library/Application Support/Shoal`;
//! then loaded into the system domain (`launchctl bootstrap system`). The file work
//! runs on any Unix (with a root directory, as the tests do); `launchctl` only on macOS.

#[cfg(unix)]
use crate::{copy_atomic, io, remove_file, set_mode, under, write_atomic, JOIN_TOKEN_FILE};
#[cfg(unix)]
use crate::{InstallOptions, ServiceError, UninstallOptions};
#[cfg(unix)]
use std::path::PathBuf;

/// The daemon's definition, as packaged.
pub const PLIST: &str = include_str!("../../../packaging/macos/dev.shoal.node.plist");
/// Its launchd label.
pub const LABEL: &str = "dev.shoal.node";
/// Where the definition is installed.
pub const PLIST_PATH: &str = "/Library/LaunchDaemons/dev.shoal.node.plist";
/// Where the packaged definition runs the binary from (and `install` puts it).
pub const BIN: &str = "/usr/local/bin/shoal";
/// The daemon's data directory.
pub const DATA_DIR: &str = "/Library/Application Support/Shoal";
/// Where the daemon's output goes.
pub const LOG_DIR: &str = "/Library/Logs/Shoal";

/// The definition for a binary at `bin`: the packaged one, with the program's path
/// (the first `<string>` of `ProgramArguments`) replaced.
pub fn plist_for(bin: &str) -> String {
    let packaged = format!("<string>{BIN}</string>");
    PLIST.replacen(&packaged, &format!("<string>{}</string>", xml_escape(bin)), 1)
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Install and load the daemon; what was done, a line each. With a root directory the
/// files are written there and nothing is loaded.
#[cfg(unix)]
pub fn install(o: &InstallOptions) -> Result<Vec<String>, ServiceError> {
    let live = o.root.is_none();
    let root = o.root.clone().unwrap_or_else(|| PathBuf::from("/"));
    if live && !crate::is_root() {
        return Err(ServiceError::NotAdmin("installing a service needs root: sudo shoal service install".into()));
    }
    let mut done = Vec::new();
    let bin = under(&root, BIN);
    if !(live && o.exe == std::path::Path::new(BIN)) {
        copy_atomic(&o.exe, &bin, 0o755)?;
        done.push(format!("installed {}", bin.display()));
    }
    let plist = under(&root, PLIST_PATH);
    // launchd loads only definitions owned by root and not writable by others.
    write_atomic(&plist, plist_for(BIN).as_bytes(), 0o644)?;
    done.push(format!("wrote {}", plist.display()));
    for dir in [DATA_DIR, LOG_DIR] {
        let d = under(&root, dir);
        std::fs::create_dir_all(&d).map_err(io(&d))?;
    }
    let data = under(&root, DATA_DIR);
    set_mode(&data, 0o700)?;
    if let Some(token) = &o.join_token {
        let file = data.join(JOIN_TOKEN_FILE);
        write_atomic(&file, format!("{token}\n").as_bytes(), 0o600)?;
        done.push(format!("the node joins with the token in {}", file.display()));
    }
    if live {
        // Loaded already (an earlier install): out first, so the new definition counts.
        let _ = crate::run("launchctl", &["bootout", &format!("system/{LABEL}")]);
        // launchd may still be tearing the old one down ("Bootstrap failed: 5"): retry.
        let mut tries = 0;
        while let Err(e) = crate::run("launchctl", &["bootstrap", "system", PLIST_PATH]) {
            tries += 1;
            if tries == 10 {
                return Err(e);
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        done.push(format!(
            "{LABEL} runs and starts at boot (data in {DATA_DIR}, log in {LOG_DIR}); status: sudo launchctl \
             print system/{LABEL}"
        ));
    }
    Ok(done)
}

/// Unload and remove the daemon (and, purging, its data); what was done.
#[cfg(unix)]
pub fn uninstall(o: &UninstallOptions) -> Result<Vec<String>, ServiceError> {
    let live = o.root.is_none();
    let root = o.root.clone().unwrap_or_else(|| PathBuf::from("/"));
    if live && !crate::is_root() {
        return Err(ServiceError::NotAdmin("removing a service needs root: sudo shoal service uninstall".into()));
    }
    let mut done = Vec::new();
    if live {
        // Not loaded is fine.
        let _ = crate::run("launchctl", &["bootout", &format!("system/{LABEL}")]);
    }
    for path in [PLIST_PATH, BIN] {
        let p = under(&root, path);
        if remove_file(&p)? {
            done.push(format!("removed {}", p.display()));
        }
    }
    let data = under(&root, DATA_DIR);
    crate::purge_or_keep(&data, o.purge, &mut done)?;
    Ok(done)
}

/// launchd's view of the daemon (`launchctl print`); its exit code (0: loaded).
#[cfg(unix)]
pub fn status() -> Result<i32, ServiceError> {
    let status = std::process::Command::new("launchctl")
        .args(["print", &format!("system/{LABEL}")])
        .status()
        .map_err(|e| ServiceError::Command { command: "launchctl print".into(), detail: e.to_string() })?;
    Ok(status.code().unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_definition_points_at_the_binary_and_nothing_else_changes() {
        assert_eq!(plist_for(BIN), PLIST);
        let other = plist_for("/opt/shoal & co/shoal");
        let changed: Vec<(&str, &str)> = PLIST.lines().zip(other.lines()).filter(|(a, b)| a != b).collect();
        assert_eq!(
            changed,
            [("        <string>/usr/local/bin/shoal</string>", "        <string>/opt/shoal &amp; co/shoal</string>")]
        );
        for key in ["RunAtLoad", "KeepAlive", "SuccessfulExit", "ProcessType", LABEL, DATA_DIR] {
            assert!(PLIST.contains(key), "{key}");
        }
    }
}
