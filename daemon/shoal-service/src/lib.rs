//! Shoal as the machine's service, for people who run the bare binary (the packages
//! install the same definitions): `install`, `uninstall` and `status` under the
//! platform's service manager — systemd on Linux ([`systemd`]), launchd on macOS
//! ([`launchd`]), the Service Control Manager on Windows (`windows`, which also runs
//! the node as a service). The service definitions are the packaged files, embedded.
//!
//! No engine and no networking here: the crate builds and is type-checked for every
//! target on any machine (`cargo check -p shoal-service --target …`).

pub mod launchd;
pub mod systemd;
#[cfg(windows)]
pub mod windows;

use std::path::{Path, PathBuf};

/// What went wrong installing, removing or querying the service.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// A file could not be read, written or removed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A system tool (systemctl, useradd, launchctl, netsh) failed.
    #[error("{command} failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status or why it could not run.
        detail: String,
    },
    /// Installing or removing a service needs the administrator.
    #[error("{0}")]
    NotAdmin(String),
    /// The package manager owns the service; the package's tools must change it.
    #[error("{0}")]
    Packaged(String),
    /// The service manager refused (Windows' SCM).
    #[error("the service manager: {0}")]
    Manager(String),
}

/// How to install the service.
#[derive(Clone, Debug)]
pub struct InstallOptions {
    /// The binary to install (usually the running one).
    pub exe: PathBuf,
    /// A join token, already checked by the caller: the node joins with it at start.
    pub join_token: Option<String>,
    /// Write the files under this directory instead of `/`, and start nothing.
    pub root: Option<PathBuf>,
}

/// How to remove the service.
#[derive(Clone, Debug, Default)]
pub struct UninstallOptions {
    /// Also delete the node's data.
    pub purge: bool,
    /// As for install: under this directory, and stop nothing.
    pub root: Option<PathBuf>,
}

/// The name of the file in the data directory a join token is read from (the node
/// reads it at start, as `shoal serve --join-token` would take it).
pub const JOIN_TOKEN_FILE: &str = "join-token";

/// `path` (absolute) under `root`.
#[cfg(unix)]
pub(crate) fn under(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ServiceError + '_ {
    move |source| ServiceError::Io { path: path.to_owned(), source }
}

/// Write `bytes` to `path` through a temporary file and a rename: a crash leaves the
/// old file or the new one, never half of one.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), ServiceError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = path.with_extension("shoal-tmp");
    std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
    set_mode(&tmp, mode)?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Copy `from` to `to` the same way.
pub(crate) fn copy_atomic(from: &Path, to: &Path, mode: u32) -> Result<(), ServiceError> {
    let dir = to.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = to.with_extension("shoal-tmp");
    std::fs::copy(from, &tmp).map_err(io(&tmp))?;
    set_mode(&tmp, mode)?;
    std::fs::rename(&tmp, to).map_err(io(to))
}

/// Remove a file; one that is not there is not an error. Whether it was there.
pub(crate) fn remove_file(path: &Path) -> Result<bool, ServiceError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(path)(e)),
    }
}

/// Remove a directory tree; one that is not there is not an error. Whether it was there.
pub(crate) fn remove_tree(path: &Path) -> Result<bool, ServiceError> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(path)(e)),
    }
}

/// On uninstall: delete the node's data when purging, else say where it was kept.
pub(crate) fn purge_or_keep(data: &Path, purge: bool, done: &mut Vec<String>) -> Result<(), ServiceError> {
    if purge {
        if remove_tree(data)? {
            done.push(format!("deleted {}", data.display()));
        }
    } else if data.exists() {
        done.push(format!("kept {} (the node's key and cluster state; --purge deletes it)", data.display()));
    }
    Ok(())
}

#[cfg(unix)]
pub(crate) fn set_mode(path: &Path, mode: u32) -> Result<(), ServiceError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io(path))
}

/// Windows has no modes: files take the folder's access list.
#[cfg(not(unix))]
pub(crate) fn set_mode(_: &Path, _: u32) -> Result<(), ServiceError> {
    Ok(())
}

/// Run a system tool; an error says which and why.
pub(crate) fn run(cmd: &str, args: &[&str]) -> Result<(), ServiceError> {
    let command = format!("{cmd} {}", args.join(" "));
    let status = std::process::Command::new(cmd)
        .args(args)
        .status()
        .map_err(|e| ServiceError::Command { command: command.clone(), detail: e.to_string() })?;
    if !status.success() {
        return Err(ServiceError::Command { command, detail: status.to_string() });
    }
    Ok(())
}

/// Whether this process runs as root (Unix).
#[cfg(unix)]
pub(crate) fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}
