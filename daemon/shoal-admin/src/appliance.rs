//! A hub appliance's system side, as files: the node (user `shoal`, no privileges) and
//! the image's root-owned scripts talk only through `<data dir>/appliance/`, a folder
//! root owns (on the hub; the image makes it so), with one the node may write in,
//! `inbox/`. Root never writes in the inbox and reads its files only after copying
//! them out without following links (security review F3: a folder the node controls
//! could have root write through a link it planted):
//!
//! - `inbox/settings.json`, written here (atomically: `settings.json.tmp`, fsync, rename;
//!   mode 0600, it holds the WiFi passphrase): `{"timezone": "Europe/Paris" | null,
//!   "wifi": {"ssid", "passphrase"} | null}`, validated before it is written;
//! - `inbox/request.json`, written here the same way: `{"id": "<16 hex>", "action":
//!   "apply" | "update" | "reset" | "reboot", "at": <unix seconds>}`;
//! - `inbox/update.raucb`, an update bundle uploaded from the page (streamed there by the
//!   upload route, at most [`MAX_BUNDLE_BYTES`]);
//! - `status.json`, written by the system side and only read here: absent or malformed
//!   reads as unknown (`None`), never as an error.
//!
//! The page reaches it through [`crate::AdminBackend::appliance`] and the
//! `appliance_*` actions ([`act`]).

use crate::{Action, ActionError};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The folder, under the node's data directory.
pub const DIR: &str = "appliance";
/// The folder in it the node writes, the only one.
pub const INBOX: &str = "inbox";
/// The system settings the node writes.
pub const SETTINGS_FILE: &str = "settings.json";
/// The request the node writes.
pub const REQUEST_FILE: &str = "request.json";
/// The update bundle uploaded from the page.
pub const BUNDLE_FILE: &str = "update.raucb";
/// What the system side reports.
pub const STATUS_FILE: &str = "status.json";
/// The digits of a setup code as someone typed it (spaces, dashes and the like left out).
pub fn code_digits(text: &str) -> String {
    text.chars().filter(char::is_ascii_digit).take(64).collect()
}

/// The box's setup code, beside `status.json` (root's: the image's
/// `usr/lib/shoal-hub/setup-code` makes it at first boot and shows it on the console and
/// the boot partition): what the page asks a machine of the LAN for before it sets the
/// first password (security review F10).
pub const SETUP_CODE_FILE: &str = "setup-code";
/// Largest update bundle taken.
pub const MAX_BUNDLE_BYTES: u64 = 4 << 30;
/// Where time zones are looked up.
pub const ZONEINFO: &str = "/usr/share/zoneinfo";
/// Largest `status.json` read (a few hundred bytes in practice).
const MAX_STATUS_BYTES: u64 = 64 << 10;
/// Longest time zone name taken (the longest in the database has 32 characters).
const MAX_ZONE: usize = 64;

/// Why a setting was refused, or a file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ApplianceError {
    /// Not a time zone of the system's database.
    #[error("time zone {zone}: {why}")]
    Timezone {
        /// The name given, quoted and cut short.
        zone: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Not a usable WiFi network name.
    #[error("WiFi network name: {0}")]
    Ssid(&'static str),
    /// Not a usable WPA2 passphrase.
    #[error("WiFi passphrase: {0}")]
    Passphrase(&'static str),
    /// `update` asked before a bundle was uploaded.
    #[error("no update bundle was uploaded: upload one first")]
    NoBundle,
    /// A file of the folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The system gave no random bytes for a request id.
    #[error("no randomness: {0}")]
    Random(String),
}

impl ApplianceError {
    /// The HTTP status that answers it: 400 for a bad setting, 409 for a missing
    /// bundle, 500 for the disk.
    pub fn status(&self) -> u16 {
        match self {
            ApplianceError::Timezone { .. } | ApplianceError::Ssid(_) | ApplianceError::Passphrase(_) => 400,
            ApplianceError::NoBundle => 409,
            ApplianceError::Io { .. } | ApplianceError::Random(_) => 500,
        }
    }
}

impl From<ApplianceError> for ActionError {
    fn from(e: ApplianceError) -> ActionError {
        ActionError { status: e.status(), message: e.to_string() }
    }
}

/// The system settings the page manages (`settings.json`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SystemSettings {
    /// A time zone of the database (`Europe/Paris`, `UTC`); `None`: the image's default.
    pub timezone: Option<String>,
    /// The WiFi network to join; `None`: none (wired only).
    pub wifi: Option<Wifi>,
}

impl SystemSettings {
    /// What the page is shown: the time zone and the WiFi network's name, never its
    /// passphrase.
    pub fn public(&self) -> serde_json::Value {
        json!({
            "timezone": self.timezone,
            "wifi": self.wifi.as_ref().map(|w| json!({"ssid": w.ssid})),
        })
    }
}

/// A change of the settings: for each, `None` keeps it, `Some(None)` clears it,
/// `Some(Some(v))` sets it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// The time zone.
    pub timezone: Option<Option<String>>,
    /// The WiFi network.
    pub wifi: Option<Option<Wifi>>,
}

/// A WiFi network: its name and WPA2 passphrase (empty: an open network).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Wifi {
    /// The network's name, 1 to 32 bytes of UTF-8 without control characters.
    pub ssid: String,
    /// 8 to 63 printable ASCII characters (WPA2-PSK), or empty for an open network.
    #[serde(default)]
    pub passphrase: String,
}

impl std::fmt::Debug for Wifi {
    /// Without the passphrase: actions are logged.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wifi").field("ssid", &self.ssid).field("open", &self.passphrase.is_empty()).finish()
    }
}

/// What the system side is asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestKind {
    /// Apply `settings.json` now.
    Apply,
    /// Install `update.raucb`, then reboot.
    Update,
    /// Factory reset: wipe every piece of data, back to the first boot, and reboot.
    Reset,
    /// Reboot.
    Reboot,
}

/// One request (`request.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// 16 random hex digits: `status.json` names the request it reports on by it.
    pub id: String,
    /// What to do.
    pub action: RequestKind,
    /// When it was asked, Unix seconds.
    pub at: u64,
}

/// What the system side reports (`status.json`); every field optional, unknown ones
/// ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Status {
    /// The slot booted ("A" or "B").
    pub booted: Option<String>,
    /// The image's version.
    pub version: Option<String>,
    /// The last request seen and how it went.
    pub request: Option<RequestStatus>,
    /// The last update and how it went.
    pub update: Option<UpdateStatus>,
    /// The time zone in effect.
    pub timezone: Option<String>,
    /// The WiFi network joined, if any.
    pub wifi: Option<String>,
    /// Whether a hardware watchdog guards the box.
    pub hardware_watchdog: Option<bool>,
    /// The size of the data partition (models, shards, settings), bytes.
    pub data_bytes: Option<u64>,
}

/// The state of a request, as the system side reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RequestStatus {
    /// The request's id.
    pub id: String,
    /// Its action.
    pub action: String,
    /// "running", "done" or "failed".
    pub state: String,
    /// For people.
    pub message: String,
}

/// The state of the last update, as the system side reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct UpdateStatus {
    /// "none", "installing", "installed", "good", "failed" or "rolled-back".
    pub state: String,
    /// For people.
    pub message: String,
    /// When it changed, Unix seconds.
    pub at: u64,
}

/// A hub appliance's folder.
#[derive(Clone, Debug)]
pub struct Appliance {
    /// `<data dir>/appliance`: the system side's status.
    dir: PathBuf,
    /// `<data dir>/appliance/inbox`: what the node writes.
    inbox: PathBuf,
    /// The time zone database ([`ZONEINFO`]).
    zoneinfo: PathBuf,
    /// This machine's host name (the page may be reached as `<name>.local`).
    host: Option<String>,
    /// One writer of the folder's files at a time (they share `.tmp` names).
    writing: Arc<Mutex<()>>,
}

impl Appliance {
    /// The appliance folder of the node whose data directory is `data_dir` and its
    /// inbox, each created if missing (the folder 0755, the inbox 0770: on the hub the
    /// image makes the folder root's and the inbox the node's); `host` is this
    /// machine's host name.
    pub fn open(data_dir: &Path, host: Option<String>) -> Result<Appliance, ApplianceError> {
        let dir = data_dir.join(DIR);
        let inbox = dir.join(INBOX);
        make_dir(&dir, 0o755)?;
        make_dir(&inbox, 0o770)?;
        // A box made before the inbox kept its settings beside status.json: carried
        // over once, so the page still shows them.
        let (old, new) = (dir.join(SETTINGS_FILE), inbox.join(SETTINGS_FILE));
        if !new.exists() && old.is_file() && !old.is_symlink() {
            if let Ok(bytes) = std::fs::read(&old) {
                write_atomic(&inbox, SETTINGS_FILE, &bytes)?;
            }
        }
        let host = host.map(|h| h.trim().to_ascii_lowercase()).filter(|h| !h.is_empty());
        Ok(Appliance { dir, inbox, zoneinfo: PathBuf::from(ZONEINFO), host, writing: Arc::default() })
    }

    /// The same, looking time zones up under `zoneinfo` (tests).
    pub fn with_zoneinfo(mut self, zoneinfo: PathBuf) -> Appliance {
        self.zoneinfo = zoneinfo;
        self
    }

    /// The folder (the system side's `status.json`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The folder the node writes (settings, requests, the bundle).
    pub fn inbox(&self) -> &Path {
        &self.inbox
    }

    /// This machine's host name, lower case.
    pub fn host_name(&self) -> Option<&str> {
        self.host.as_deref()
    }

    /// The box's setup code ([`SETUP_CODE_FILE`]), its digits only; `None` when there is
    /// none (or it is a link, or not a code): then no machine of the LAN may set the
    /// box up.
    pub fn setup_code(&self) -> Option<String> {
        let path = self.dir.join(SETUP_CODE_FILE);
        let meta = std::fs::symlink_metadata(&path).ok()?;
        if !meta.is_file() || meta.len() > 64 {
            return None;
        }
        let digits = code_digits(&std::fs::read_to_string(&path).ok()?);
        (digits.len() >= 8).then_some(digits)
    }

    /// Where an uploaded bundle goes.
    pub fn bundle_path(&self) -> PathBuf {
        self.inbox.join(BUNDLE_FILE)
    }

    /// The settings written last; none yet (or an unreadable file): the defaults.
    pub fn settings(&self) -> SystemSettings {
        let path = self.inbox.join(SETTINGS_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!("{}: {e}; read as no settings", path.display());
                SystemSettings::default()
            }),
            Err(_) => SystemSettings::default(),
        }
    }

    /// Whether `settings` may be written: a time zone of the database, a WiFi network
    /// with a valid name and passphrase.
    pub fn validate(&self, settings: &SystemSettings) -> Result<(), ApplianceError> {
        if let Some(zone) = &settings.timezone {
            check_timezone(&self.zoneinfo, zone)?;
        }
        if let Some(wifi) = &settings.wifi {
            check_wifi(wifi)?;
        }
        Ok(())
    }

    /// Validate `settings`, write them, and ask the system side to apply them; the
    /// request made. Refused settings change nothing.
    pub fn store(&self, settings: &SystemSettings) -> Result<Request, ApplianceError> {
        let _one = lock(&self.writing);
        self.store_locked(settings)
    }

    /// The settings written last with `change` applied to them (see [`Change`]), not
    /// written.
    pub fn changed(&self, change: &Change) -> SystemSettings {
        let mut settings = self.settings();
        if let Some(zone) = &change.timezone {
            settings.timezone = zone.clone();
        }
        if let Some(wifi) = &change.wifi {
            settings.wifi = wifi.clone();
        }
        settings
    }

    /// Change the settings written last as `change` says, write them and ask the system
    /// side to apply them (one read-change-write at a time); the settings and the
    /// request. Refused settings change nothing.
    pub fn change(&self, change: &Change) -> Result<(SystemSettings, Request), ApplianceError> {
        let _one = lock(&self.writing);
        let settings = self.changed(change);
        let request = self.store_locked(&settings)?;
        Ok((settings, request))
    }

    /// [`Appliance::store`], the caller holding `writing`.
    fn store_locked(&self, settings: &SystemSettings) -> Result<Request, ApplianceError> {
        self.validate(settings)?;
        // Invariant: strings and options always serialise.
        let bytes = serde_json::to_vec_pretty(settings).expect("settings serialise");
        write_atomic(&self.inbox, SETTINGS_FILE, &bytes)?;
        self.write_request(RequestKind::Apply)
    }

    /// Ask the system side for `kind` (an update only once a bundle is there); the
    /// request made.
    pub fn request(&self, kind: RequestKind) -> Result<Request, ApplianceError> {
        if kind == RequestKind::Update && !self.bundle_path().is_file() {
            return Err(ApplianceError::NoBundle);
        }
        let _one = lock(&self.writing);
        self.write_request(kind)
    }

    /// Write `request.json` (the caller holds `writing`).
    fn write_request(&self, action: RequestKind) -> Result<Request, ApplianceError> {
        let mut id = [0u8; 8];
        getrandom::getrandom(&mut id).map_err(|e| ApplianceError::Random(e.to_string()))?;
        let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let request = Request { id: hex::encode(id), action, at };
        // Invariant: strings and numbers always serialise.
        let bytes = serde_json::to_vec_pretty(&request).expect("a request serialises");
        write_atomic(&self.inbox, REQUEST_FILE, &bytes)?;
        tracing::info!(id = %request.id, action = ?action, "appliance request written");
        Ok(request)
    }

    /// What the system side reports; `None` when it says nothing readable (no file,
    /// too large, not the expected JSON).
    pub fn status(&self) -> Option<Status> {
        let file = std::fs::File::open(self.dir.join(STATUS_FILE)).ok()?;
        let mut bytes = Vec::new();
        file.take(MAX_STATUS_BYTES + 1).read_to_end(&mut bytes).ok()?;
        if bytes.len() as u64 > MAX_STATUS_BYTES {
            return None;
        }
        // An object only (serde would read a struct from an array too).
        match serde_json::from_slice(&bytes).ok()? {
            v @ serde_json::Value::Object(_) => serde_json::from_value(v).ok(),
            _ => None,
        }
    }
}

/// Create the folder `dir` with `mode` if it is missing (the mode asked at creation is
/// cut by the umask, so it is set again).
fn make_dir(dir: &Path, mode: u32) -> Result<(), ApplianceError> {
    if dir.is_dir() {
        return Ok(());
    }
    let mut builder = std::fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, mode);
    match builder.create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        Err(source) => return Err(ApplianceError::Io { path: dir.to_path_buf(), source }),
    }
    #[cfg(unix)]
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(mode))
        .map_err(|source| ApplianceError::Io { path: dir.to_path_buf(), source })?;
    #[cfg(not(unix))]
    let _ = mode;
    Ok(())
}

/// Whether `zone` names a time zone of the database at `zoneinfo`: `UTC`, or a
/// relative path of `[A-Za-z0-9_+-/]` (no empty or `..` component, no leading `/`) to a
/// TZif file (not a folder, nor one of the database's tables).
pub fn check_timezone(zoneinfo: &Path, zone: &str) -> Result<(), ApplianceError> {
    if zone == "UTC" {
        return Ok(());
    }
    let refuse = |why| {
        let shown: String = zone.chars().take(40).collect();
        Err(ApplianceError::Timezone { zone: format!("{shown:?}"), why })
    };
    if zone.is_empty() || zone.len() > MAX_ZONE {
        return refuse("a time zone name has 1 to 64 characters");
    }
    if !zone.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'+' | b'-' | b'/')) {
        return refuse("only letters, digits, '_', '+', '-' and '/' (like Europe/Paris)");
    }
    if zone.starts_with('/') || zone.split('/').any(|c| c.is_empty() || c == "..") {
        return refuse("not a name in the time zone database");
    }
    let mut magic = [0u8; 4];
    let is_zone = std::fs::File::open(zoneinfo.join(zone))
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|()| &magic == b"TZif");
    if !is_zone {
        return refuse("no such time zone");
    }
    Ok(())
}

/// Whether `wifi` is a network the system side can join: a name of 1 to 32 bytes
/// without control characters; a passphrase of 8 to 63 printable ASCII characters
/// (WPA2-PSK), or none (an open network).
pub fn check_wifi(wifi: &Wifi) -> Result<(), ApplianceError> {
    if wifi.ssid.is_empty() || wifi.ssid.len() > 32 {
        return Err(ApplianceError::Ssid("it has 1 to 32 bytes"));
    }
    if wifi.ssid.chars().any(char::is_control) {
        return Err(ApplianceError::Ssid("no control characters"));
    }
    let p = &wifi.passphrase;
    if !p.is_empty() && !(8..=63).contains(&p.len()) {
        return Err(ApplianceError::Passphrase("8 to 63 characters, or none for an open network"));
    }
    if !p.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err(ApplianceError::Passphrase(
            "printable ASCII characters only (letters, digits, punctuation, space)",
        ));
    }
    Ok(())
}

/// Write `bytes` to `dir/name` atomically: `name.tmp` (mode 0600 from its creation),
/// fsynced, renamed over `name`, the folder fsynced so the rename lasts too.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), ApplianceError> {
    let tmp = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ApplianceError::Io { path, source }
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(&tmp).map_err(io(&tmp))?;
    // A `.tmp` left over from before keeps its mode: set it.
    #[cfg(unix)]
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600)).map_err(io(&tmp))?;
    file.write_all(bytes).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Why an appliance action is refused on a node that is not one.
pub const NOT_AN_APPLIANCE: &str =
    "this node is not a hub appliance: system settings, updates and resets are managed on the hub box's page";

/// Do one of the `appliance_*` actions on `appliance` (`None`: this node is not one,
/// 409); any other action is a 400. The file writes run off the async threads.
pub async fn act(appliance: Option<&Appliance>, action: Action) -> Result<serde_json::Value, ActionError> {
    let Some(appliance) = appliance.cloned() else {
        return Err(ActionError { status: 409, message: NOT_AN_APPLIANCE.into() });
    };
    /// What an action asks of the folder.
    enum Job {
        Settings(Change),
        Request(RequestKind),
    }
    let job = match action {
        Action::ApplianceSettings { timezone, wifi } => Job::Settings(Change { timezone, wifi }),
        Action::ApplianceUpdate => Job::Request(RequestKind::Update),
        Action::ApplianceReset => Job::Request(RequestKind::Reset),
        Action::ApplianceReboot => Job::Request(RequestKind::Reboot),
        _ => return Err(ActionError { status: 400, message: "not an appliance action".into() }),
    };
    tokio::task::spawn_blocking(move || match job {
        Job::Settings(change) => {
            let (settings, request) = appliance.change(&change)?;
            Ok(json!({"settings": settings.public(), "request": request}))
        }
        Job::Request(kind) => Ok(json!({"request": appliance.request(kind)?})),
    })
    .await
    .map_err(|e| ActionError { status: 500, message: e.to_string() })?
    .map_err(|e: ApplianceError| e.into())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The guarded section only writes files: a panic there leaves nothing half-changed
    // in memory.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A zone database (`<tmp>/zoneinfo`) with Europe/Paris (a TZif file), a folder and
    /// a table; and beside it, outside the database, a TZif file `TZescape`.
    fn zoneinfo() -> (tempfile::TempDir, PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let z = root.path().join("zoneinfo");
        std::fs::create_dir_all(z.join("Europe")).unwrap();
        std::fs::write(z.join("Europe/Paris"), b"TZif2\0\0\0").unwrap();
        std::fs::write(z.join("America_Fake"), b"TZif2\0\0\0").unwrap();
        std::fs::write(z.join("zone1970"), b"# not a zone").unwrap();
        std::fs::write(root.path().join("TZescape"), b"TZif2\0\0\0").unwrap();
        (root, z)
    }

    fn wifi(ssid: &str, passphrase: &str) -> Wifi {
        Wifi { ssid: ssid.into(), passphrase: passphrase.into() }
    }

    #[test]
    fn time_zones_must_be_files_of_the_database() {
        let (_root, z) = zoneinfo();
        for ok in ["Europe/Paris", "UTC", "America_Fake"] {
            assert!(check_timezone(&z, ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Europe",
            "Europe/",
            "Europe//Paris",
            "/etc/localtime",
            "../TZescape",
            "Europe/../Europe/Paris",
            "Europe/Paris ",
            "Europe\\Paris",
            "Mars/Olympus",
            "zone1970",
            "Europe/Paris\n",
            &"A".repeat(65),
        ] {
            let e = check_timezone(&z, bad).unwrap_err();
            assert!(matches!(e, ApplianceError::Timezone { .. }), "{bad:?}: {e}");
            assert_eq!(e.status(), 400);
        }
        // The system's own database, where there is one.
        if Path::new(ZONEINFO).join("Europe/Paris").exists() {
            assert!(check_timezone(Path::new(ZONEINFO), "Europe/Paris").is_ok());
            assert!(check_timezone(Path::new(ZONEINFO), "Europe").is_err());
        }
    }

    #[test]
    fn wifi_names_and_passphrases_are_checked() {
        for ok in [wifi("home", "correct horse"), wifi("café ☕", ""), wifi(&"s".repeat(32), &"p".repeat(63))] {
            assert!(check_wifi(&ok).is_ok(), "{ok:?}");
        }
        for bad in
            [wifi("", "correct horse"), wifi(&"s".repeat(33), ""), wifi("é".repeat(17).as_str(), ""), wifi("a\nb", "")]
        {
            assert!(matches!(check_wifi(&bad), Err(ApplianceError::Ssid(_))), "{bad:?}");
        }
        for bad in ["short", &"p".repeat(64), "päss word", "tab\there!"] {
            assert!(matches!(check_wifi(&wifi("home", bad)), Err(ApplianceError::Passphrase(_))), "{bad:?}");
        }
        assert!(!format!("{:?}", wifi("home", "secret words")).contains("secret"), "Debug hides the passphrase");
    }

    #[test]
    fn settings_are_written_atomically_with_mode_0600_and_refused_ones_change_nothing() {
        let (data, (_root, z)) = (tempfile::tempdir().unwrap(), zoneinfo());
        let a = Appliance::open(data.path(), Some("HubBox".into())).unwrap().with_zoneinfo(z);
        assert_eq!(a.host_name(), Some("hubbox"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(a.dir()).unwrap().permissions().mode() & 0o777, 0o755);
            assert_eq!(std::fs::metadata(a.inbox()).unwrap().permissions().mode() & 0o777, 0o770);
        }
        assert_eq!(a.settings(), SystemSettings::default(), "nothing written yet");
        let settings =
            SystemSettings { timezone: Some("Europe/Paris".into()), wifi: Some(wifi("home", "correct horse")) };
        // A stale temporary file readable by all is replaced, not reused as it was.
        std::fs::write(a.inbox().join("settings.json.tmp"), b"stale").unwrap();
        #[cfg(unix)]
        std::fs::set_permissions(
            a.inbox().join("settings.json.tmp"),
            std::os::unix::fs::PermissionsExt::from_mode(0o644),
        )
        .unwrap();
        let request = a.store(&settings).unwrap();
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(a.inbox().join(SETTINGS_FILE)).unwrap()).unwrap();
        assert_eq!(
            written,
            json!({"timezone": "Europe/Paris", "wifi": {"ssid": "home", "passphrase": "correct horse"}})
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(a.inbox().join(SETTINGS_FILE)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(!a.inbox().join("settings.json.tmp").exists(), "the temporary file was renamed");
        assert_eq!(a.settings(), settings);
        let on_disk: Request = serde_json::from_slice(&std::fs::read(a.inbox().join(REQUEST_FILE)).unwrap()).unwrap();
        assert_eq!(on_disk, request);
        assert_eq!(request.action, RequestKind::Apply);
        assert!(request.id.len() == 16 && request.id.bytes().all(|b| b.is_ascii_hexdigit()), "{}", request.id);
        assert!(request.at > 1_600_000_000);
        assert_eq!(a.settings().public(), json!({"timezone": "Europe/Paris", "wifi": {"ssid": "home"}}));

        let before = std::fs::read(a.inbox().join(SETTINGS_FILE)).unwrap();
        let bad = SystemSettings { timezone: Some("Mars/Olympus".into()), wifi: None };
        assert_eq!(a.store(&bad).unwrap_err().status(), 400);
        let bad = SystemSettings { timezone: None, wifi: Some(wifi("home", "short")) };
        assert_eq!(a.store(&bad).unwrap_err().status(), 400);
        assert_eq!(std::fs::read(a.inbox().join(SETTINGS_FILE)).unwrap(), before, "refused: unchanged");
        assert_eq!(
            serde_json::from_slice::<Request>(&std::fs::read(a.inbox().join(REQUEST_FILE)).unwrap()).unwrap(),
            request
        );

        // A change keeps what it does not name, and clears what it names as none.
        let (after, _) = a.change(&Change { timezone: Some(Some("UTC".into())), wifi: None }).unwrap();
        assert_eq!(after, SystemSettings { timezone: Some("UTC".into()), wifi: Some(wifi("home", "correct horse")) });
        let (after, _) = a.change(&Change { timezone: None, wifi: Some(None) }).unwrap();
        assert_eq!(after, SystemSettings { timezone: Some("UTC".into()), wifi: None });
        assert!(a.change(&Change { timezone: Some(Some("Nowhere".into())), wifi: None }).is_err());
        assert_eq!(a.settings(), after);
        let (_, _) = a.change(&Change { timezone: Some(None), wifi: Some(Some(wifi("cafe", ""))) }).unwrap();
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(a.inbox().join(SETTINGS_FILE)).unwrap()).unwrap();
        assert_eq!(written, json!({"timezone": null, "wifi": {"ssid": "cafe", "passphrase": ""}}));
    }

    #[test]
    fn requests_name_their_action_and_an_update_needs_a_bundle() {
        let data = tempfile::tempdir().unwrap();
        let a = Appliance::open(data.path(), None).unwrap();
        assert!(matches!(a.request(RequestKind::Update), Err(ApplianceError::NoBundle)));
        assert!(!a.inbox().join(REQUEST_FILE).exists(), "a refused update writes nothing");
        std::fs::write(a.bundle_path(), b"bundle").unwrap();
        let mut ids = std::collections::HashSet::new();
        for (kind, name) in
            [(RequestKind::Update, "update"), (RequestKind::Reset, "reset"), (RequestKind::Reboot, "reboot")]
        {
            let r = a.request(kind).unwrap();
            let on_disk: serde_json::Value =
                serde_json::from_slice(&std::fs::read(a.inbox().join(REQUEST_FILE)).unwrap()).unwrap();
            assert_eq!(on_disk, json!({"id": r.id, "action": name, "at": r.at}));
            ids.insert(r.id);
        }
        assert_eq!(ids.len(), 3, "a new id each time");
    }

    #[test]
    fn status_is_read_leniently_and_never_fails() {
        let data = tempfile::tempdir().unwrap();
        let a = Appliance::open(data.path(), None).unwrap();
        assert_eq!(a.status(), None, "absent");
        let path = a.dir().join(STATUS_FILE);
        std::fs::write(
            &path,
            r#"{"booted": "B", "version": "0.2.0", "future": [1, 2],
                "request": {"id": "00112233aabbccdd", "action": "update", "state": "running", "message": "installing"},
                "update": {"state": "installing", "message": "", "at": 5},
                "timezone": "Europe/Paris", "wifi": null, "hardware_watchdog": true, "data_bytes": 4096}"#,
        )
        .unwrap();
        let s = a.status().unwrap();
        assert_eq!((s.booted.as_deref(), s.version.as_deref()), (Some("B"), Some("0.2.0")));
        assert_eq!(s.request.unwrap().state, "running");
        assert_eq!(s.update.unwrap().state, "installing");
        assert_eq!((s.wifi, s.hardware_watchdog, s.data_bytes), (None, Some(true), Some(4096)));
        for bad in ["", "{", "[]", r#"{"booted": 5}"#, "\u{0}"] {
            std::fs::write(&path, bad).unwrap();
            assert_eq!(a.status(), None, "{bad:?}");
        }
        std::fs::write(&path, format!("{{\"version\": \"{}\"}}", "v".repeat(70 << 10))).unwrap();
        assert_eq!(a.status(), None, "too large");
        std::fs::write(&path, "{}").unwrap();
        assert_eq!(a.status(), Some(Status::default()));
    }
}
