//! systemd (Linux): the unit the .deb ships (`packaging/linux/shoal.service`,
//! embedded), written with `ExecStart` pointing at the installed binary; the `shoal`
//! system user (in the GPU groups), `/var/lib/shoal`, a join token; then enabled and
//! started. The package's maintainer scripts do the same for the .deb.

#[cfg(unix)]
use crate::{copy_atomic, io, is_root, remove_file, run, set_mode, under, write_atomic, JOIN_TOKEN_FILE};
#[cfg(unix)]
use crate::{InstallOptions, ServiceError, UninstallOptions};
#[cfg(unix)]
use std::path::{Path, PathBuf};

/// The systemd unit, as packaged.
pub const UNIT: &str = include_str!("../../../packaging/linux/shoal.service");
/// Where the packaged unit runs the binary from.
pub const PACKAGED_BIN: &str = "/usr/bin/shoal";
/// Where `install` puts a bare binary (/usr/bin stays the package manager's).
pub const LOCAL_BIN: &str = "/usr/local/bin/shoal";
/// Where `install` writes the unit (the package's lives in /usr/lib).
pub const UNIT_PATH: &str = "/etc/systemd/system/shoal.service";
/// Where the package installs its unit.
pub const PACKAGED_UNIT_PATH: &str = "/usr/lib/systemd/system/shoal.service";
/// The service's data directory.
pub const DATA_DIR: &str = "/var/lib/shoal";

/// The unit for a binary at `bin`: the packaged one, with `ExecStart` pointing at `bin`.
pub fn unit_for(bin: &str) -> String {
    if bin == PACKAGED_BIN {
        return UNIT.to_string();
    }
    UNIT.lines()
        .map(|l| match l.strip_prefix("ExecStart=") {
            Some(rest) => format!("ExecStart={}", rest.replacen(PACKAGED_BIN, bin, 1)),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// Install and start the service; what was done, a line each.
#[cfg(unix)]
pub fn install(o: &InstallOptions) -> Result<Vec<String>, ServiceError> {
    let live = o.root.is_none();
    let root = o.root.clone().unwrap_or_else(|| PathBuf::from("/"));
    if live && !is_root() {
        return Err(ServiceError::NotAdmin("installing a service needs root: sudo shoal service install".into()));
    }
    if live && Path::new(PACKAGED_UNIT_PATH).exists() {
        return Err(ServiceError::Packaged(
            "Shoal's package is installed and runs shoal.service already (systemctl status shoal); to join a \
             cluster: sudo -u shoal shoal join TOKEN"
                .into(),
        ));
    }
    let mut done = Vec::new();

    // The binary: the given one where it already is a system path, else a copy.
    let bin = if live && (o.exe == Path::new(PACKAGED_BIN) || o.exe == Path::new(LOCAL_BIN)) {
        o.exe.to_string_lossy().into_owned()
    } else {
        let target = under(&root, LOCAL_BIN);
        copy_atomic(&o.exe, &target, 0o755)?;
        done.push(format!("installed {}", target.display()));
        LOCAL_BIN.to_string()
    };
    let unit = under(&root, UNIT_PATH);
    write_atomic(&unit, unit_for(&bin).as_bytes(), 0o644)?;
    done.push(format!("wrote {}", unit.display()));

    // The user the node runs as; the packaged unit names it.
    let passwd = under(&root, "/etc/passwd");
    let user = passwd.exists();
    if user {
        if ensure_user(&root)? {
            done.push("created the system user shoal".into());
        }
    } else {
        done.push(format!("no {}: the shoal user is not created", passwd.display()));
    }
    let data = under(&root, DATA_DIR);
    std::fs::create_dir_all(&data).map_err(io(&data))?;
    set_mode(&data, 0o750)?;
    if let Some(token) = &o.join_token {
        let file = data.join(JOIN_TOKEN_FILE);
        write_atomic(&file, format!("{token}\n").as_bytes(), 0o600)?;
        done.push(format!("the node joins with the token in {}", file.display()));
    }
    if user {
        chown_shoal(&root, &data)?;
    }
    if !live {
        return Ok(done);
    }
    run("systemctl", &["daemon-reload"])?;
    run("systemctl", &["enable", "shoal.service"])?;
    // A restart, not a start: a service running from an earlier install must take the
    // new binary, unit and token. Type=notify: this returns once the node is ready.
    run("systemctl", &["restart", "shoal.service"])?;
    done.push(format!(
        "shoal.service runs and starts at boot (data in {DATA_DIR}); status: systemctl status shoal; logs: \
         journalctl -u shoal; the CLI: sudo -u shoal shoal status"
    ));
    Ok(done)
}

/// Stop and remove the service (and, purging, its data); what was done.
#[cfg(unix)]
pub fn uninstall(o: &UninstallOptions) -> Result<Vec<String>, ServiceError> {
    let live = o.root.is_none();
    let root = o.root.clone().unwrap_or_else(|| PathBuf::from("/"));
    if live && !is_root() {
        return Err(ServiceError::NotAdmin("removing a service needs root: sudo shoal service uninstall".into()));
    }
    if live && Path::new(PACKAGED_UNIT_PATH).exists() && !Path::new(UNIT_PATH).exists() {
        return Err(ServiceError::Packaged(
            "Shoal was installed by its package: sudo apt remove shoal (purge deletes its data too)".into(),
        ));
    }
    let mut done = Vec::new();
    if live {
        // Stopped first: a running node would write into what is being removed. Not
        // enabled or not running is fine.
        let _ = run("systemctl", &["disable", "--now", "shoal.service"]);
    }
    for path in [UNIT_PATH, LOCAL_BIN] {
        let p = under(&root, path);
        if remove_file(&p)? {
            done.push(format!("removed {}", p.display()));
        }
    }
    if live {
        let _ = run("systemctl", &["daemon-reload"]);
    }
    let data = under(&root, DATA_DIR);
    crate::purge_or_keep(&data, o.purge, &mut done)?;
    Ok(done)
}

/// systemd's view of the service, as `systemctl status` prints it; its exit code
/// (0 running, 3 stopped, 4 not installed).
#[cfg(unix)]
pub fn status() -> Result<i32, ServiceError> {
    let status = std::process::Command::new("systemctl")
        .args(["status", "--no-pager", "shoal.service"])
        .status()
        .map_err(|e| ServiceError::Command { command: "systemctl status".into(), detail: e.to_string() })?;
    Ok(status.code().unwrap_or(1))
}

/// The `shoal` system user and group, in `render` and `video` where those exist (the
/// GPUs' device groups). Whether the user was created now.
#[cfg(unix)]
fn ensure_user(root: &Path) -> Result<bool, ServiceError> {
    let root_arg = root.to_string_lossy().into_owned();
    let passwd_path = under(root, "/etc/passwd");
    let passwd = std::fs::read_to_string(&passwd_path).map_err(io(&passwd_path))?;
    let created = !passwd.lines().any(|l| l.starts_with("shoal:"));
    if created {
        run(
            "useradd",
            &[
                "--root",
                &root_arg,
                "--system",
                "--user-group",
                "--home-dir",
                DATA_DIR,
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--comment",
                "Shoal node",
                "shoal",
            ],
        )?;
    }
    let groups = std::fs::read_to_string(under(root, "/etc/group")).unwrap_or_default();
    for g in ["render", "video"] {
        if groups.lines().any(|l| l.starts_with(&format!("{g}:"))) {
            run("usermod", &["--root", &root_arg, "--append", "--groups", g, "shoal"])?;
        }
    }
    Ok(created)
}

/// Give `dir` and what it holds to the shoal user (its ids from `root`'s passwd).
#[cfg(unix)]
fn chown_shoal(root: &Path, dir: &Path) -> Result<(), ServiceError> {
    let passwd_path = under(root, "/etc/passwd");
    let passwd = std::fs::read_to_string(&passwd_path).map_err(io(&passwd_path))?;
    let ids = passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        match f.as_slice() {
            ["shoal", _, uid, gid, ..] => Some((uid.parse::<u32>().ok()?, gid.parse::<u32>().ok()?)),
            _ => None,
        }
    });
    let Some((uid, gid)) = ids else {
        return Err(ServiceError::Command {
            command: "useradd shoal".into(),
            detail: format!("no shoal user in {}", passwd_path.display()),
        });
    };
    let entries = std::fs::read_dir(dir).map_err(io(dir))?;
    for path in std::iter::once(dir.to_path_buf()).chain(entries.flatten().map(|e| e.path())) {
        std::os::unix::fs::chown(&path, Some(uid), Some(gid)).map_err(io(&path))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unit_points_at_the_installed_binary_and_nothing_else_changes() {
        assert_eq!(unit_for(PACKAGED_BIN), UNIT);
        let local = unit_for(LOCAL_BIN);
        let changed: Vec<(&str, &str)> = UNIT.lines().zip(local.lines()).filter(|(a, b)| a != b).collect();
        assert_eq!(
            changed,
            [(
                "ExecStart=/usr/bin/shoal serve --data-dir /var/lib/shoal",
                "ExecStart=/usr/local/bin/shoal serve --data-dir /var/lib/shoal"
            )]
        );
        assert_eq!(UNIT.lines().count(), local.lines().count());
    }
}
