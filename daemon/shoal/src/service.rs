//! `shoal service install|uninstall|status`: Shoal as this machine's service, for
//! people who downloaded the bare binary. On Linux it installs the very unit the .deb
//! ships (`packaging/linux/shoal.service`, embedded here), only pointing `ExecStart` at
//! the binary it installed; the user, data directory and join token are set up as the
//! package's scripts do. Other systems are refused with what to do instead.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use shoal_membership::node::JOIN_TOKEN_FILE;
use shoal_membership::token::JoinToken;
use std::path::{Path, PathBuf};
#[cfg(target_os = "linux")]
use std::process::Command;

/// The systemd unit, as packaged.
pub const SYSTEMD_UNIT: &str = include_str!("../../../packaging/linux/shoal.service");
/// Where the packaged unit runs the binary from.
pub const PACKAGED_BIN: &str = "/usr/bin/shoal";
/// Where `service install` puts a bare binary (the packaged one stays the package's).
pub const LOCAL_BIN: &str = "/usr/local/bin/shoal";
/// Where `service install` writes the unit (the package's lives in /usr/lib).
pub const UNIT_PATH: &str = "/etc/systemd/system/shoal.service";
/// Where the package installs its unit.
pub const PACKAGED_UNIT_PATH: &str = "/usr/lib/systemd/system/shoal.service";
/// The system service's data directory on Linux.
pub const LINUX_DATA_DIR: &str = "/var/lib/shoal";

/// `shoal service …`.
#[derive(Subcommand, Debug)]
pub enum ServiceCommand {
    /// Install Shoal as this machine's service and start it (as root): the binary, the
    /// systemd unit the .deb ships, a `shoal` system user, data in /var/lib/shoal.
    Install(InstallArgs),
    /// Stop and remove the service; the node's data stays unless `--purge`.
    Uninstall(UninstallArgs),
    /// Whether the service runs (systemd's view).
    Status,
}

/// `shoal service install`.
#[derive(Args, Debug)]
pub struct InstallArgs {
    /// A join token from a member (`shoal nodes token`): the node joins that cluster
    /// when it starts.
    #[arg(long, value_name = "TOKEN")]
    join: Option<String>,
    /// Write the files under this directory instead of `/`, and start nothing (to stage
    /// an image, or to see what would be written). Users are created only where the
    /// directory holds an /etc/passwd.
    #[arg(long, value_name = "DIR")]
    root: Option<PathBuf>,
}

/// `shoal service uninstall`.
#[derive(Args, Debug)]
pub struct UninstallArgs {
    /// Also delete the node's data (its key, its cluster state, models and shards).
    #[arg(long)]
    purge: bool,
    /// As for install: remove the files under this directory, and stop nothing.
    #[arg(long, value_name = "DIR")]
    root: Option<PathBuf>,
}

/// `shoal service …`.
#[cfg(not(target_os = "linux"))]
pub fn service(_: ServiceCommand) -> Result<()> {
    bail!(
        "`shoal service` installs a systemd service and runs on Linux only for now; on macOS use \
         packaging/macos (a launchd daemon), on Windows packaging/windows"
    )
}

/// `shoal service …`.
#[cfg(target_os = "linux")]
pub fn service(c: ServiceCommand) -> Result<()> {
    match c {
        ServiceCommand::Install(a) => install(a),
        ServiceCommand::Uninstall(a) => uninstall(a),
        ServiceCommand::Status => {
            let status = Command::new("systemctl")
                .args(["status", "--no-pager", "shoal.service"])
                .status()
                .context("running systemctl (is this a systemd system?)")?;
            // systemctl's own exit code says it: 0 running, 3 stopped, 4 not installed.
            std::process::exit(status.code().unwrap_or(1));
        }
    }
}

/// The unit `service install` writes for a binary at `bin`: the packaged one, with
/// `ExecStart` pointing at `bin`.
pub fn unit_for(bin: &str) -> String {
    if bin == PACKAGED_BIN {
        return SYSTEMD_UNIT.to_string();
    }
    SYSTEMD_UNIT
        .lines()
        .map(|l| match l.strip_prefix("ExecStart=") {
            Some(rest) => format!("ExecStart={}", rest.replacen(PACKAGED_BIN, bin, 1)),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

#[cfg(target_os = "linux")]
/// `path` (absolute) under `root`.
fn under(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

#[cfg(target_os = "linux")]
fn install(a: InstallArgs) -> Result<()> {
    let live = a.root.is_none();
    let root = a.root.clone().unwrap_or_else(|| PathBuf::from("/"));
    if live && !is_root() {
        bail!("installing a service needs root: sudo shoal service install");
    }
    // Checked before anything is written: a typo must not leave half an install.
    let token = a
        .join
        .as_deref()
        .map(|t| t.trim().parse::<JoinToken>().map(|_| t.trim().to_string()))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--join: {e}"))?;
    if live && Path::new(PACKAGED_UNIT_PATH).exists() {
        bail!(
            "Shoal's package is installed (it runs shoal.service already: systemctl status shoal); \
             to join a cluster: sudo -u shoal shoal join TOKEN"
        );
    }

    // The binary: the running one where it already is a system path, else a copy.
    let exe = std::env::current_exe().context("locating this binary")?;
    let exe = std::fs::canonicalize(&exe).unwrap_or(exe);
    let bin = if live && (exe == Path::new(PACKAGED_BIN) || exe == Path::new(LOCAL_BIN)) {
        exe.to_string_lossy().into_owned()
    } else {
        let target = under(&root, LOCAL_BIN);
        copy_atomic(&exe, &target, 0o755)?;
        println!("installed {}", target.display());
        LOCAL_BIN.to_string()
    };

    let unit = under(&root, UNIT_PATH);
    write_atomic(&unit, unit_for(&bin).as_bytes(), 0o644)?;
    println!("wrote {}", unit.display());

    // The user the node runs as, in the GPU groups where they exist.
    let passwd = under(&root, "/etc/passwd");
    let user = if passwd.exists() {
        ensure_user(&root)?;
        true
    } else {
        println!("no {}: the shoal user is not created", passwd.display());
        false
    };
    let data = under(&root, LINUX_DATA_DIR);
    std::fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
    set_mode(&data, 0o750)?;
    if let Some(token) = &token {
        let file = data.join(JOIN_TOKEN_FILE);
        write_atomic(&file, format!("{token}\n").as_bytes(), 0o600)?;
        println!("the node joins with the token in {}", file.display());
    }
    if user {
        chown_shoal(&root, &data)?;
    }
    if !live {
        return Ok(());
    }
    run("systemctl", &["daemon-reload"])?;
    // Type=notify: this returns once the node is ready (or failed).
    run("systemctl", &["enable", "--now", "shoal.service"])?;
    if token.is_some() {
        // Already running from an earlier install: the token is read at start.
        run("systemctl", &["restart", "shoal.service"])?;
    }
    println!(
        "shoal.service runs and starts at boot (data in {LINUX_DATA_DIR}).\n\
         status: systemctl status shoal · logs: journalctl -u shoal · CLI: sudo -u shoal shoal status"
    );
    Ok(())
}

#[cfg(target_os = "linux")]
fn uninstall(a: UninstallArgs) -> Result<()> {
    let live = a.root.is_none();
    let root = a.root.clone().unwrap_or_else(|| PathBuf::from("/"));
    if live && !is_root() {
        bail!("removing a service needs root: sudo shoal service uninstall");
    }
    if live && Path::new(PACKAGED_UNIT_PATH).exists() && !Path::new(UNIT_PATH).exists() {
        bail!("Shoal was installed by its package: sudo apt remove shoal (or purge, to delete its data)");
    }
    if live {
        // Stopped first: a running node would write into what is being removed.
        let _ = Command::new("systemctl").args(["disable", "--now", "shoal.service"]).status();
    }
    for path in [UNIT_PATH, LOCAL_BIN] {
        let p = under(&root, path);
        match std::fs::remove_file(&p) {
            Ok(()) => println!("removed {}", p.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", p.display())),
        }
    }
    if live {
        let _ = Command::new("systemctl").arg("daemon-reload").status();
    }
    let data = under(&root, LINUX_DATA_DIR);
    if a.purge {
        match std::fs::remove_dir_all(&data) {
            Ok(()) => println!("deleted {}", data.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("deleting {}", data.display())),
        }
    } else if data.exists() {
        println!("kept {} (the node's key and cluster state; --purge deletes it)", data.display());
    }
    Ok(())
}

#[cfg(target_os = "linux")]
/// The `shoal` system user and group, in `render` and `video` where those exist.
fn ensure_user(root: &Path) -> Result<()> {
    let root_arg = root.to_string_lossy().into_owned();
    let known = std::fs::read_to_string(under(root, "/etc/passwd"))
        .map(|p| p.lines().any(|l| l.starts_with("shoal:")))
        .unwrap_or(false);
    if !known {
        run(
            "useradd",
            &[
                "--root",
                &root_arg,
                "--system",
                "--user-group",
                "--home-dir",
                LINUX_DATA_DIR,
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--comment",
                "Shoal node",
                "shoal",
            ],
        )?;
        println!("created the system user shoal");
    }
    let groups = std::fs::read_to_string(under(root, "/etc/group")).unwrap_or_default();
    for g in ["render", "video"] {
        if groups.lines().any(|l| l.starts_with(&format!("{g}:"))) {
            run("usermod", &["--root", &root_arg, "--append", "--groups", g, "shoal"])?;
        }
    }
    Ok(())
}

#[cfg(target_os = "linux")]
/// Give `dir` and what it holds to the shoal user (ids read from `root`'s passwd).
fn chown_shoal(root: &Path, dir: &Path) -> Result<()> {
    let passwd = std::fs::read_to_string(under(root, "/etc/passwd")).context("reading /etc/passwd")?;
    let (uid, gid) = passwd
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.first() == Some(&"shoal") && f.len() > 3).then(|| (f[2].parse::<u32>().ok(), f[3].parse::<u32>().ok()))
        })
        .and_then(|(u, g)| Some((u?, g?)))
        .context("the shoal user is not in /etc/passwd")?;
    for entry in std::iter::once(dir.to_path_buf())
        .chain(std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()))
    {
        std::os::unix::fs::chown(&entry, Some(uid), Some(gid))
            .with_context(|| format!("giving {} to the shoal user", entry.display()))?;
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn run(cmd: &str, args: &[&str]) -> Result<()> {
    let status = Command::new(cmd).args(args).status().with_context(|| format!("running {cmd}"))?;
    if !status.success() {
        bail!("{cmd} {} failed ({status})", args.join(" "));
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

#[cfg(target_os = "linux")]
fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))
}

#[cfg(target_os = "linux")]
/// Write `bytes` to `path` through a temporary file and a rename: a crash leaves the
/// old file or the new one, never half of one.
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let dir = path.parent().context("a path without a parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension("shoal-tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    set_mode(&tmp, mode)?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

#[cfg(target_os = "linux")]
fn copy_atomic(from: &Path, to: &Path, mode: u32) -> Result<()> {
    let dir = to.parent().context("a path without a parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = to.with_extension("shoal-tmp");
    std::fs::copy(from, &tmp).with_context(|| format!("copying {} to {}", from.display(), tmp.display()))?;
    set_mode(&tmp, mode)?;
    std::fs::rename(&tmp, to).with_context(|| format!("installing {}", to.display()))
}
