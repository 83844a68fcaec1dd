//! `shoal service install|uninstall|status`: Shoal as this machine's service, for
//! people who downloaded the bare binary, through the platform's service manager
//! (`shoal-service`: systemd on Linux, launchd on macOS, the SCM on Windows). The join
//! token is checked here, before anything is written.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use shoal_membership::token::JoinToken;
use shoal_service::{InstallOptions, UninstallOptions};
use std::path::PathBuf;

/// `shoal service …`.
#[derive(Subcommand, Debug)]
pub enum ServiceCommand {
    /// Install Shoal as this machine's service and start it (as root or administrator):
    /// on Linux the systemd unit the .deb ships, a `shoal` system user, data in
    /// /var/lib/shoal; on macOS a launchd daemon; on Windows a service of the SCM.
    Install(InstallArgs),
    /// Stop and remove the service; the node's data stays unless `--purge`.
    Uninstall(UninstallArgs),
    /// Whether the service runs (the service manager's view).
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
    /// The service manager to write for [default: this system's]. With `--root`, another
    /// system's files can be staged (`systemd`, `launchd`).
    #[arg(long, value_name = "MANAGER", hide = true)]
    manager: Option<Manager>,
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
    /// As for install.
    #[arg(long, value_name = "MANAGER", hide = true)]
    manager: Option<Manager>,
}

/// A service manager.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Manager {
    /// Linux.
    Systemd,
    /// macOS.
    Launchd,
    /// Windows' Service Control Manager.
    Windows,
}

impl Manager {
    fn native() -> Manager {
        if cfg!(windows) {
            Manager::Windows
        } else if cfg!(target_os = "macos") {
            Manager::Launchd
        } else {
            Manager::Systemd
        }
    }
}

/// Pick the manager: another system's only to stage files under `--root`.
fn manager(given: Option<Manager>, root: &Option<PathBuf>) -> Result<Manager> {
    let native = Manager::native();
    match given {
        Some(m) if m != native && root.is_none() => bail!("--manager {m:?} is for staging files with --root"),
        Some(m) => Ok(m),
        None => Ok(native),
    }
}

/// `shoal service …`.
pub fn service(c: ServiceCommand) -> Result<()> {
    match c {
        ServiceCommand::Install(a) => {
            // Checked before anything is written: a typo must not leave half an install.
            let join_token = a
                .join
                .as_deref()
                .map(|t| t.trim().parse::<JoinToken>().map(|_| t.trim().to_string()))
                .transpose()
                .map_err(|e| anyhow::anyhow!("--join: {e}"))?;
            let exe = std::env::current_exe().context("locating this binary")?;
            let exe = std::fs::canonicalize(&exe).unwrap_or(exe);
            let o = InstallOptions { exe, join_token, root: a.root.clone() };
            let done = match manager(a.manager, &a.root)? {
                Manager::Systemd => systemd_install(&o)?,
                Manager::Launchd => launchd_install(&o)?,
                Manager::Windows => windows_install(&o)?,
            };
            done.iter().for_each(|l| println!("{l}"));
        }
        ServiceCommand::Uninstall(a) => {
            let o = UninstallOptions { purge: a.purge, root: a.root.clone() };
            let done = match manager(a.manager, &a.root)? {
                Manager::Systemd => systemd_uninstall(&o)?,
                Manager::Launchd => launchd_uninstall(&o)?,
                Manager::Windows => windows_uninstall(&o)?,
            };
            done.iter().for_each(|l| println!("{l}"));
        }
        ServiceCommand::Status => {
            let code = status()?;
            std::process::exit(code);
        }
    }
    Ok(())
}

#[cfg(unix)]
fn systemd_install(o: &InstallOptions) -> Result<Vec<String>> {
    Ok(shoal_service::systemd::install(o)?)
}
#[cfg(unix)]
fn systemd_uninstall(o: &UninstallOptions) -> Result<Vec<String>> {
    Ok(shoal_service::systemd::uninstall(o)?)
}
#[cfg(unix)]
fn launchd_install(o: &InstallOptions) -> Result<Vec<String>> {
    Ok(shoal_service::launchd::install(o)?)
}
#[cfg(unix)]
fn launchd_uninstall(o: &UninstallOptions) -> Result<Vec<String>> {
    Ok(shoal_service::launchd::uninstall(o)?)
}
#[cfg(not(unix))]
fn systemd_install(_: &InstallOptions) -> Result<Vec<String>> {
    bail!("systemd files are staged from a Unix system")
}
#[cfg(not(unix))]
fn systemd_uninstall(_: &UninstallOptions) -> Result<Vec<String>> {
    bail!("systemd files are staged from a Unix system")
}
#[cfg(not(unix))]
fn launchd_install(_: &InstallOptions) -> Result<Vec<String>> {
    bail!("launchd files are staged from a Unix system")
}
#[cfg(not(unix))]
fn launchd_uninstall(_: &UninstallOptions) -> Result<Vec<String>> {
    bail!("launchd files are staged from a Unix system")
}
#[cfg(windows)]
fn windows_install(o: &InstallOptions) -> Result<Vec<String>> {
    Ok(shoal_service::windows::install(o)?)
}
#[cfg(windows)]
fn windows_uninstall(o: &UninstallOptions) -> Result<Vec<String>> {
    Ok(shoal_service::windows::uninstall(o)?)
}
#[cfg(not(windows))]
fn windows_install(_: &InstallOptions) -> Result<Vec<String>> {
    bail!("a Windows service is installed from Windows")
}
#[cfg(not(windows))]
fn windows_uninstall(_: &UninstallOptions) -> Result<Vec<String>> {
    bail!("a Windows service is removed from Windows")
}

fn status() -> Result<i32> {
    #[cfg(windows)]
    return Ok(shoal_service::windows::status()?);
    #[cfg(target_os = "macos")]
    return Ok(shoal_service::launchd::status()?);
    #[cfg(not(any(windows, target_os = "macos")))]
    return Ok(shoal_service::systemd::status()?);
}

#[cfg(test)]
mod tests {
    /// The service installers write the join token where the node reads it.
    #[test]
    fn the_join_token_file_is_the_one_the_node_reads() {
        assert_eq!(shoal_service::JOIN_TOKEN_FILE, shoal_membership::node::JOIN_TOKEN_FILE);
    }
}
