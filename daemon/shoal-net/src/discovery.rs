//! mDNS discovery: each node advertises itself as one `_shoal._udp.local.` instance
//! (its id, cluster, ports and a memory summary in TXT properties) and browses for the
//! others, reporting them as [`DiscoveryEvent`]s on a tokio channel.
//!
//! A hub also advertises its admin page ([`Discovery::advertise_web`]): the web service
//! `Shoal._http._tcp.local.` on the host `shoal.local.`, so that mdns-sd answers
//! A/AAAA queries for `shoal.local` and a browser on the LAN finds the box by name.
//!
//! Built on `mdns-sd`, whose daemon runs on its own thread; a second plain thread turns
//! its events into ours. What peers advertise is untrusted input: a TXT record that does
//! not decode is ignored with one warning, never a panic or an event. Discovery only
//! says who is there; whether to trust a node is decided by membership (pinned keys).

use crate::identity::NodeId;
use mdns_sd::{IfKind, IfPredicate, ResolvedService, ServiceDaemon, ServiceEvent, ServiceInfo, TxtProperties};
use shoal_types::{ClusterId, NodeInventory, Role};
use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// The DNS-SD service type every Shoal node registers and browses.
pub const SERVICE_TYPE: &str = "_shoal._udp.local.";

/// The DNS-SD service type of a hub's admin page.
pub const WEB_SERVICE_TYPE: &str = "_http._tcp.local.";
/// The instance name of a hub's admin page (mdns-sd renames it if another takes it).
pub const WEB_INSTANCE: &str = "Shoal";
/// The host name a hub answers for (mdns-sd probes it and, if another hub holds it,
/// takes `shoal-2.local.` and so on).
pub const WEB_HOST: &str = "shoal.local.";
/// Where the admin page is under the web service (its TXT `path`, RFC 6763 §7.1 style).
pub const WEB_PATH: &str = "/admin/";

/// Version of the protocols a node speaks (advertised as `pv`); peers with another
/// version are still reported, membership decides what to do with them.
pub const PROTOCOL_VERSION: u32 = 1;

/// DNS-SD limit for one `key=value` string in a TXT record (RFC 6763 §6.1).
pub const MAX_PROPERTY_BYTES: usize = 255;
/// Limit for a whole TXT record, well inside one mDNS packet on any link.
pub const MAX_TXT_BYTES: usize = 1300;
/// Limit for the device summary (`dev`).
pub const MAX_DEVICES_BYTES: usize = 100;
/// Limit for the version string (`ver`).
pub const MAX_VERSION_BYTES: usize = 32;

/// What the `cl` property says when a node belongs to no cluster yet.
const UNPAIRED: &str = "unpaired";
/// Capacity of the event channel handed to the caller.
const EVENT_CAPACITY: usize = 256;
/// At most this many instances with bad TXT records are remembered (to warn once each).
const MAX_REMEMBERED_BAD: usize = 1024;
/// How long the goodbye of an unregistration is given before the daemon stops (it
/// re-sends the goodbye after 120 ms).
const GOODBYE_GRACE: Duration = Duration::from_millis(200);

/// What a node advertises about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advert {
    /// The node's id (its public key).
    pub node: NodeId,
    /// Protocol version it speaks ([`PROTOCOL_VERSION`] for this build).
    pub protocol: u32,
    /// The cluster it belongs to, if it has been paired into one.
    pub cluster: Option<ClusterId>,
    /// Its QUIC port (the SRV record's port).
    pub port: u16,
    /// Its second QUIC port, for the join protocol.
    pub join_port: u16,
    /// RAM available to new allocations, bytes.
    pub ram_available: u64,
    /// Free memory over its GPUs, bytes.
    pub vram_free: u64,
    /// Device summary, e.g. "8c/31G+RTX 4070 12G" (at most [`MAX_DEVICES_BYTES`]).
    pub devices: String,
    /// PC or hub.
    pub role: Role,
    /// Shoal version string (at most [`MAX_VERSION_BYTES`]).
    pub version: String,
}

/// Why a TXT record does not decode into an [`Advert`]; `field` is the TXT key (or
/// `port` for the SRV port, `txt` for the record as a whole).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TxtError {
    /// A required property is absent.
    #[error("TXT property `{field}` is missing")]
    Missing {
        /// The missing key.
        field: &'static str,
    },
    /// A property is present but its value is unusable.
    #[error("TXT property `{field}`: {reason}")]
    Invalid {
        /// The offending key.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl TxtError {
    /// The field the error is about.
    pub fn field(&self) -> &'static str {
        match self {
            TxtError::Missing { field } | TxtError::Invalid { field, .. } => field,
        }
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> TxtError {
    TxtError::Invalid { field, reason: reason.into() }
}

/// The start of an untrusted string, quoted and escaped, for error messages and logs.
fn quoted(s: &str) -> String {
    const SHOWN: usize = 40;
    match s.char_indices().nth(SHOWN) {
        Some((cut, _)) => format!("{:?}…", &s[..cut]),
        None => format!("{s:?}"),
    }
}

/// `s` cut to at most `max` bytes on a character boundary, control characters replaced
/// by spaces (so that what we advertise always passes [`Advert::from_txt`]).
fn clean_text(s: &str, max: usize) -> String {
    let mut out: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if out.len() > max {
        let mut cut = max;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
}

/// The DNS-SD instance name of a node: the first 16 hex digits of its id.
pub fn instance_name(node: &NodeId) -> String {
    let mut hex = node.to_string();
    hex.truncate(16);
    hex
}

/// The value of `field` in `props` (first occurrence, key case-insensitive), checked
/// against the field's length limit (which keeps `key=value` within
/// [`MAX_PROPERTY_BYTES`] too).
fn field_value<'a>(props: &'a [(String, String)], field: &'static str, max: usize) -> Result<&'a str, TxtError> {
    let (_, v) = props.iter().find(|(k, _)| k.eq_ignore_ascii_case(field)).ok_or(TxtError::Missing { field })?;
    debug_assert!(field.len() + 1 + max <= MAX_PROPERTY_BYTES);
    if v.len() > max {
        return Err(invalid(field, format!("{} bytes, over the limit of {max}", v.len())));
    }
    Ok(v.as_str())
}

/// A strictly decimal number: ASCII digits only (no sign, no spaces), in range.
fn parse_decimal<T: std::str::FromStr>(field: &'static str, v: &str) -> Result<T, TxtError> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid(field, format!("{} is not a decimal number", quoted(v))));
    }
    v.parse::<T>().map_err(|_| invalid(field, format!("{} is out of range", quoted(v))))
}

impl Advert {
    /// This node's advert from its inventory: RAM, VRAM, device summary and version
    /// come from `inventory`; the protocol is [`PROTOCOL_VERSION`].
    pub fn new(
        node: NodeId,
        cluster: Option<ClusterId>,
        role: Role,
        port: u16,
        join_port: u16,
        inventory: &NodeInventory,
    ) -> Advert {
        Advert {
            node,
            protocol: PROTOCOL_VERSION,
            cluster,
            port,
            join_port,
            ram_available: inventory.ram_available_bytes,
            vram_free: inventory.vram_free_bytes(),
            devices: inventory.summary(MAX_DEVICES_BYTES),
            role,
            version: clean_text(&inventory.shoal_version, MAX_VERSION_BYTES),
        }
    }

    /// The TXT properties: `id`, `pv`, `cl`, `jp`, `ram`, `vram`, `dev`, `role`, `ver`.
    /// `dev` and `ver` are cut (on character boundaries) to their limits and control
    /// characters in them become spaces, so every property stays within
    /// [`MAX_PROPERTY_BYTES`] and the record within [`MAX_TXT_BYTES`].
    pub fn to_txt(&self) -> Vec<(String, String)> {
        let cluster = self.cluster.map_or_else(|| UNPAIRED.to_string(), |c| c.to_string());
        vec![
            ("id".into(), self.node.to_string()),
            ("pv".into(), self.protocol.to_string()),
            ("cl".into(), cluster),
            ("jp".into(), self.join_port.to_string()),
            ("ram".into(), self.ram_available.to_string()),
            ("vram".into(), self.vram_free.to_string()),
            ("dev".into(), clean_text(&self.devices, MAX_DEVICES_BYTES)),
            ("role".into(), self.role.to_string()),
            ("ver".into(), clean_text(&self.version, MAX_VERSION_BYTES)),
        ]
    }

    /// Decode TXT properties (and the SRV record's `port`). Strict: every property must be
    /// present and valid, values within their limits, the record within
    /// [`MAX_TXT_BYTES`]. Keys are matched case-insensitively and the first occurrence
    /// of a key counts (RFC 6763 §6.4); unknown keys are ignored.
    pub fn from_txt(props: &[(String, String)], port: u16) -> Result<Advert, TxtError> {
        let total: usize = props.iter().map(|(k, v)| 2 + k.len() + v.len()).sum();
        if total > MAX_TXT_BYTES {
            return Err(invalid("txt", format!("{total} bytes, over the limit of {MAX_TXT_BYTES}")));
        }
        let get = |field: &'static str, max: usize| field_value(props, field, max);
        let text = |field: &'static str, max: usize| -> Result<String, TxtError> {
            let v = get(field, max)?;
            if v.chars().any(char::is_control) {
                return Err(invalid(field, format!("{} contains control characters", quoted(v))));
            }
            Ok(v.to_string())
        };
        if port == 0 {
            return Err(invalid("port", "the service port is 0"));
        }
        let id = get("id", 64)?;
        let node = id.parse::<NodeId>().map_err(|_| invalid("id", format!("{} is not 64 hex digits", quoted(id))))?;
        let protocol = parse_decimal::<u32>("pv", get("pv", 10)?)?;
        let cl = get("cl", 32)?;
        let cluster = if cl == UNPAIRED {
            None
        } else {
            Some(
                cl.parse::<ClusterId>()
                    .map_err(|_| invalid("cl", format!("{} is neither 32 hex digits nor {UNPAIRED:?}", quoted(cl))))?,
            )
        };
        let join_port = parse_decimal::<u16>("jp", get("jp", 5)?)?;
        if join_port == 0 {
            return Err(invalid("jp", "the join port is 0"));
        }
        let ram_available = parse_decimal::<u64>("ram", get("ram", 20)?)?;
        let vram_free = parse_decimal::<u64>("vram", get("vram", 20)?)?;
        let devices = text("dev", MAX_DEVICES_BYTES)?;
        let role_str = get("role", 3)?;
        let role =
            role_str.parse::<Role>().map_err(|_| invalid("role", format!("{} is not pc or hub", quoted(role_str))))?;
        let version = text("ver", MAX_VERSION_BYTES)?;
        Ok(Advert { node, protocol, cluster, port, join_port, ram_available, vram_free, devices, role, version })
    }

    /// Decode a TXT record as it arrives on the wire (RDATA: length-prefixed
    /// `key=value` strings, as mdns-sd parses them) and the SRV `port`: the same path a
    /// resolved service takes ([`Advert::from_txt`] after checking values are UTF-8).
    /// Public for the fuzz target (`daemon/fuzz`), which feeds it arbitrary bytes.
    pub fn from_txt_record(record: &[u8], port: u16) -> Result<Advert, TxtError> {
        txt_strings(&TxtProperties::from(record)).and_then(|p| Advert::from_txt(&p, port))
    }

    /// Worth re-registering? The node, protocol, cluster, role, ports, device summary or
    /// version changed, or RAM or VRAM changed by more than 10% of `self`'s value or by
    /// more than 512 MiB (either is enough).
    pub fn differs_materially(&self, other: &Advert) -> bool {
        fn moved(old: u64, new: u64) -> bool {
            const FLOOR: u64 = 512 << 20;
            let delta = old.abs_diff(new);
            delta > FLOOR || u128::from(delta) * 10 > u128::from(old)
        }
        self.node != other.node
            || self.protocol != other.protocol
            || self.cluster != other.cluster
            || self.role != other.role
            || self.port != other.port
            || self.join_port != other.join_port
            || self.devices != other.devices
            || self.version != other.version
            || moved(self.ram_available, other.ram_available)
            || moved(self.vram_free, other.vram_free)
    }
}

/// Which network interfaces mDNS uses.
///
/// If `allow` is non-empty, only the interfaces it names (a trailing `*` makes a
/// prefix glob; naming the loopback interface, e.g. `lo`, enables it). Otherwise every
/// non-loopback interface except the virtual bridges denied by default (`docker*`,
/// `br-*`, `virbr*`, `vEthernet*`). Either way, anything matching `deny` is excluded.
#[derive(Clone, Debug, Default)]
pub struct InterfaceFilter {
    /// Interfaces to use exclusively (globs allowed); empty means "all real ones".
    pub allow: Vec<String>,
    /// Interfaces never to use (globs allowed), on top of the default denials.
    pub deny: Vec<String>,
}

/// Interfaces never used unless allowed explicitly: container and VM bridges.
const DEFAULT_DENY: [&str; 4] = ["docker*", "br-*", "virbr*", "vEthernet*"];

/// `name` matches `pattern` (exactly, or by prefix if the pattern ends in `*`).
fn glob_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => pattern == name,
    }
}

/// Whether an interface name is a loopback's (Linux `lo`, BSD/macOS `lo0`, Windows'
/// "Loopback Pseudo-Interface 1").
fn is_loopback_name(name: &str) -> bool {
    name.strip_prefix("lo").is_some_and(|rest| rest.bytes().all(|b| b.is_ascii_digit()))
        || name.starts_with("Loopback Pseudo-Interface")
}

impl InterfaceFilter {
    /// Only the loopback interface (tests, and nodes on one machine).
    pub fn loopback() -> InterfaceFilter {
        InterfaceFilter { allow: vec!["lo".into()], deny: Vec::new() }
    }

    /// Whether mDNS may use the interface called `name` (whether it is a loopback is
    /// judged from the name).
    pub fn permits(&self, name: &str) -> bool {
        self.permits_interface(name, is_loopback_name(name))
    }

    /// Whether mDNS may use the interface `name`, which is a loopback if `loopback`.
    pub fn permits_interface(&self, name: &str, loopback: bool) -> bool {
        if self.deny.iter().any(|p| glob_matches(p, name)) {
            return false;
        }
        if !self.allow.is_empty() {
            return self.allow.iter().any(|p| glob_matches(p, name));
        }
        !loopback && !DEFAULT_DENY.iter().any(|p| glob_matches(p, name))
    }
}

/// What discovery reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiscoveryEvent {
    /// A peer appeared, or its advert or addresses changed.
    Found {
        /// What it advertises.
        advert: Advert,
        /// Its addresses (sorted, IPv4 first), to reach `advert.port` on.
        addrs: Vec<IpAddr>,
    },
    /// A peer's service went away (it said goodbye, or its records expired).
    Lost {
        /// The peer that left.
        node: NodeId,
    },
}

/// Why discovery could not start or change.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The mDNS daemon refused a command (or has stopped).
    #[error("mDNS: {0}")]
    Mdns(#[from] mdns_sd::Error),
    /// The advert would not decode on the other side.
    #[error("advert is not valid: {0}")]
    BadAdvert(#[from] TxtError),
    /// `update` was given another node's advert.
    #[error("advert is for node {new}, but discovery runs for node {ours}")]
    OtherNode {
        /// The node discovery was started for.
        ours: NodeId,
        /// The node in the rejected advert.
        new: NodeId,
    },
    /// The thread forwarding events could not be started.
    #[error("cannot start the discovery thread: {0}")]
    Thread(std::io::Error),
    /// The admin page's port was 0.
    #[error("the admin page's port is 0")]
    WebPort,
}

/// Advertises this node and browses for the others while it lives.
///
/// [`Discovery::start`] needs no tokio runtime: mdns-sd runs its own thread, and a plain
/// `std::thread` forwards its events into the tokio channel with `blocking_send`.
/// Shutting down (or dropping) blocks for about 0.2 s so that the goodbye goes out.
pub struct Discovery {
    daemon: ServiceDaemon,
    /// Our instance's full DNS-SD name.
    fullname: String,
    /// The advert registered last (what peers see) and the latest one given.
    adverts: Mutex<(Advert, Advert)>,
    /// Set when we stop, so the forwarder does not restart the browse.
    stopping: Arc<AtomicBool>,
    /// The admin page's registration (a hub's), by full name, once made.
    web: Mutex<Option<String>>,
}

impl fmt::Debug for Discovery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Discovery").field("fullname", &self.fullname).finish_non_exhaustive()
    }
}

/// The service registration for `advert`: instance and host named after the node id,
/// addresses filled in by mdns-sd for each enabled interface.
fn service_info(advert: &Advert) -> Result<ServiceInfo, DiscoveryError> {
    let instance = instance_name(&advert.node);
    let host = format!("{instance}.local.");
    let props = advert.to_txt();
    Ok(ServiceInfo::new(SERVICE_TYPE, &instance, &host, (), advert.port, &props[..])?.enable_addr_auto())
}

/// The admin page's registration: [`WEB_INSTANCE`] of [`WEB_SERVICE_TYPE`] on the host
/// [`WEB_HOST`] at `port`, TXT `path=`[`WEB_PATH`], addresses filled in by mdns-sd for
/// each enabled interface.
fn web_info(port: u16) -> Result<ServiceInfo, DiscoveryError> {
    if port == 0 {
        return Err(DiscoveryError::WebPort);
    }
    let props = [("path", WEB_PATH)];
    Ok(ServiceInfo::new(WEB_SERVICE_TYPE, WEB_INSTANCE, WEB_HOST, (), port, &props[..])?.enable_addr_auto())
}

impl Discovery {
    /// Start advertising `advert` and browsing for peers on the interfaces `filter`
    /// permits. Peers are reported on the returned channel; our own instance never is.
    pub fn start(
        advert: Advert,
        filter: &InterfaceFilter,
    ) -> Result<(Discovery, mpsc::Receiver<DiscoveryEvent>), DiscoveryError> {
        Advert::from_txt(&advert.to_txt(), advert.port)?;
        let info = service_info(&advert)?;
        let fullname = info.get_fullname().to_string();
        let daemon = ServiceDaemon::new()?;
        // mdns-sd's thread starts on every interface, loopback included (joining the
        // group there, which sends an IGMP/MLD report, but no mDNS packet before the
        // commands below run); keep only the permitted ones. The daemon keeps the
        // predicate and applies it to interfaces that appear later too.
        let stop = |e: mdns_sd::Error| {
            let _ = daemon.shutdown();
            DiscoveryError::from(e)
        };
        daemon.disable_interface(IfKind::All).map_err(stop)?;
        let filter = filter.clone();
        let permitted = IfPredicate::new(move |intf| filter.permits_interface(&intf.name, intf.is_loopback()));
        daemon.enable_interface(IfKind::Predicate(permitted)).map_err(stop)?;
        let browse = daemon.browse(SERVICE_TYPE).map_err(stop)?;
        daemon.register(info).map_err(stop)?;

        let (tx, rx) = mpsc::channel(EVENT_CAPACITY);
        let stopping = Arc::new(AtomicBool::new(false));
        let forwarder = Forwarder {
            daemon: daemon.clone(),
            tracker: Tracker::new(advert.node, fullname.clone()),
            stopping: stopping.clone(),
            tx,
        };
        if let Err(e) = std::thread::Builder::new().name("shoal-discovery".into()).spawn(move || forwarder.run(browse))
        {
            let _ = daemon.shutdown();
            return Err(DiscoveryError::Thread(e));
        }
        let adverts = Mutex::new((advert.clone(), advert));
        Ok((Discovery { daemon, fullname, adverts, stopping, web: Mutex::new(None) }, rx))
    }

    /// On a hub, also advertise its admin page at `port` (the HTTP API's) as
    /// [`WEB_INSTANCE`]`.`[`WEB_SERVICE_TYPE`] on the host [`WEB_HOST`], with the same
    /// daemon, so on the same interfaces: mdns-sd then answers A/AAAA queries for
    /// `shoal.local`, and the page is at `http://shoal.local:PORT/admin/`. A node whose
    /// advert is not a hub's advertises nothing (`Ok(false)`): one `shoal.local` per LAN
    /// is the box, not whichever PC answered first. Called again, it replaces the port.
    /// Unregistered with the node's own service when discovery stops.
    pub fn advertise_web(&self, port: u16) -> Result<bool, DiscoveryError> {
        if self.advert().role != Role::Hub {
            return Ok(false);
        }
        let info = web_info(port)?;
        let fullname = info.get_fullname().to_string();
        self.daemon.register(info)?;
        *self.web.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(fullname);
        Ok(true)
    }

    /// Replace the advert. It is re-registered (and peers see a new `Found`) only if it
    /// differs materially from the one registered last; returns whether it was.
    pub fn update(&self, advert: Advert) -> Result<bool, DiscoveryError> {
        let mut adverts = self.adverts.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (registered, latest) = &mut *adverts;
        if advert.node != registered.node {
            return Err(DiscoveryError::OtherNode { ours: registered.node, new: advert.node });
        }
        Advert::from_txt(&advert.to_txt(), advert.port)?;
        *latest = advert.clone();
        if !registered.differs_materially(&advert) {
            return Ok(false);
        }
        self.daemon.register(service_info(&advert)?)?;
        *registered = advert;
        Ok(true)
    }

    /// The advert given last (registered or not).
    pub fn advert(&self) -> Advert {
        self.adverts.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).1.clone()
    }

    /// Unregister (peers see `Lost`) and stop. Dropping does the same.
    pub fn shutdown(self) {}
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Goodbye: mdns-sd sends it at once and again after 120 ms.
        let web = self.web.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(Ok(status)) = web.map(|name| self.daemon.unregister(&name)) {
            let _ = status.recv_timeout(Duration::from_secs(1));
        }
        if let Ok(status) = self.daemon.unregister(&self.fullname) {
            let _ = status.recv_timeout(Duration::from_secs(1));
            std::thread::sleep(GOODBYE_GRACE);
        }
        // Stopping the daemon also ends the browse, which ends the forwarder thread.
        if let Ok(status) = self.daemon.shutdown() {
            let _ = status.recv_timeout(Duration::from_secs(1));
        }
    }
}

/// Turns mdns-sd's events into ours, on its own thread.
struct Forwarder {
    daemon: ServiceDaemon,
    tracker: Tracker,
    stopping: Arc<AtomicBool>,
    tx: mpsc::Sender<DiscoveryEvent>,
}

impl Forwarder {
    fn run(mut self, mut browse: mdns_sd::Receiver<ServiceEvent>) {
        loop {
            let event = browse.recv();
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            let events = match event {
                Ok(ServiceEvent::ServiceResolved(service)) => self.tracker.resolved(&service),
                Ok(ServiceEvent::ServiceRemoved(_, fullname)) => self.tracker.removed(&fullname),
                Ok(ServiceEvent::SearchStopped(_)) | Err(_) => {
                    // mdns-sd ends a browse whose channel overflows; start it again.
                    tracing::warn!("mDNS browse ended unexpectedly; browsing again");
                    std::thread::sleep(Duration::from_secs(1));
                    match self.daemon.browse(SERVICE_TYPE) {
                        Ok(again) => browse = again,
                        Err(e) => {
                            if !self.stopping.load(Ordering::SeqCst) {
                                tracing::warn!("mDNS browse cannot restart: {e}; discovery stops");
                            }
                            return;
                        }
                    }
                    Vec::new()
                }
                Ok(_) => Vec::new(),
            };
            for event in events {
                if self.tx.blocking_send(event).is_err() {
                    // Nobody listens any more.
                    let _ = self.daemon.stop_browse(SERVICE_TYPE);
                    return;
                }
            }
        }
    }
}

/// TXT properties as strings; a property whose value is not UTF-8 is an error naming
/// it (a key without a value reads as empty).
fn txt_strings(txt: &TxtProperties) -> Result<Vec<(String, String)>, TxtError> {
    const FIELDS: [&str; 9] = ["id", "pv", "cl", "jp", "ram", "vram", "dev", "role", "ver"];
    let mut out = Vec::with_capacity(txt.len());
    for prop in txt.iter() {
        let value = match prop.val() {
            None => String::new(),
            Some(bytes) => match std::str::from_utf8(bytes) {
                Ok(s) => s.to_string(),
                Err(_) => match FIELDS.iter().find(|f| f.eq_ignore_ascii_case(prop.key())) {
                    Some(field) => return Err(invalid(field, "value is not UTF-8")),
                    None => continue,
                },
            },
        };
        out.push((prop.key().to_string(), value));
    }
    Ok(out)
}

/// What we last reported about one instance.
struct Peer {
    advert: Advert,
    addrs: Vec<IpAddr>,
}

/// The peers seen so far, and which events a resolution or removal makes. No I/O
/// (apart from the warnings), so it is tested without a network.
struct Tracker {
    own_node: NodeId,
    /// Our instance's full name, lower case.
    own_fullname: String,
    /// Instances reported as found, by lower-case full name.
    peers: HashMap<String, Peer>,
    /// Instances whose last resolution did not decode, with the reason warned about.
    bad: HashMap<String, String>,
}

impl Tracker {
    fn new(own_node: NodeId, own_fullname: String) -> Tracker {
        Tracker { own_node, own_fullname: own_fullname.to_lowercase(), peers: HashMap::new(), bad: HashMap::new() }
    }

    fn resolved(&mut self, service: &ResolvedService) -> Vec<DiscoveryEvent> {
        let mut addrs: Vec<IpAddr> = service.get_addresses().iter().map(|a| a.to_ip_addr()).collect();
        addrs.sort();
        addrs.dedup();
        let decoded = txt_strings(service.get_properties()).and_then(|p| Advert::from_txt(&p, service.get_port()));
        self.observe(service.get_fullname(), decoded, addrs)
    }

    /// One resolution of `fullname`: `Found` if it is new or changed.
    fn observe(
        &mut self,
        fullname: &str,
        decoded: Result<Advert, TxtError>,
        addrs: Vec<IpAddr>,
    ) -> Vec<DiscoveryEvent> {
        let key = fullname.to_lowercase();
        if key == self.own_fullname {
            return Vec::new();
        }
        let decoded = match decoded {
            Ok(advert) if advert.node == self.own_node => Err("it claims our own node id".to_string()),
            Ok(advert) => Ok(advert),
            Err(e) => Err(e.to_string()),
        };
        let advert = match decoded {
            Ok(advert) => advert,
            Err(reason) => {
                if self.bad.get(&key) != Some(&reason) {
                    tracing::warn!(instance = %fullname.escape_debug(), "ignoring mDNS advert: {reason}");
                    if self.bad.len() >= MAX_REMEMBERED_BAD {
                        self.bad.clear();
                    }
                    self.bad.insert(key, reason);
                }
                return Vec::new();
            }
        };
        self.bad.remove(&key);
        if addrs.is_empty() {
            return Vec::new();
        }
        if let Some(peer) = self.peers.get(&key) {
            if peer.advert == advert && peer.addrs == addrs {
                return Vec::new();
            }
        }
        let mut events = Vec::new();
        if let Some(old) = self.peers.get(&key) {
            // The same instance now speaks for another node: the old one is gone.
            if old.advert.node != advert.node && !self.others_have(&key, old.advert.node) {
                events.push(DiscoveryEvent::Lost { node: old.advert.node });
            }
        }
        self.peers.insert(key, Peer { advert: advert.clone(), addrs: addrs.clone() });
        events.push(DiscoveryEvent::Found { advert, addrs });
        events
    }

    /// Whether an instance other than `key` was reported for `node`.
    fn others_have(&self, key: &str, node: NodeId) -> bool {
        self.peers.iter().any(|(k, p)| k != key && p.advert.node == node)
    }

    /// `fullname` was removed: `Lost` if it was reported (and no other instance of the
    /// same node remains).
    fn removed(&mut self, fullname: &str) -> Vec<DiscoveryEvent> {
        let key = fullname.to_lowercase();
        self.bad.remove(&key);
        match self.peers.remove(&key) {
            Some(peer) if !self.others_have(&key, peer.advert.node) => {
                vec![DiscoveryEvent::Lost { node: peer.advert.node }]
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advert() -> Advert {
        Advert {
            node: NodeId([0x5a; 32]),
            protocol: PROTOCOL_VERSION,
            cluster: Some(ClusterId([0xc1; 16])),
            port: 7400,
            join_port: 7401,
            ram_available: 24 << 30,
            vram_free: 11 << 30,
            devices: "8c/32G+RTX 4070 12G".into(),
            role: Role::Hub,
            version: "0.1.0".into(),
        }
    }

    fn set(props: &mut [(String, String)], key: &str, value: &str) {
        let slot = props.iter_mut().find(|(k, _)| k == key).expect("key present");
        slot.1 = value.to_string();
    }

    fn refused(props: &[(String, String)]) -> TxtError {
        Advert::from_txt(props, 7400).expect_err("refused")
    }

    #[test]
    fn txt_round_trips() {
        let a = advert();
        let txt = a.to_txt();
        let keys: Vec<&str> = txt.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["id", "pv", "cl", "jp", "ram", "vram", "dev", "role", "ver"]);
        assert_eq!(Advert::from_txt(&txt, 7400).unwrap(), a);
        let unpaired = Advert { cluster: None, role: Role::Pc, ..a };
        let txt = unpaired.to_txt();
        assert!(txt.contains(&("cl".into(), "unpaired".into())));
        assert_eq!(Advert::from_txt(&txt, 7400).unwrap(), unpaired);
    }

    #[test]
    fn txt_record_bytes_decode_like_a_resolved_service() {
        let a = advert();
        let mut record = Vec::new();
        for (k, v) in a.to_txt() {
            let prop = format!("{k}={v}");
            record.push(u8::try_from(prop.len()).expect("a property is at most 255 bytes"));
            record.extend_from_slice(prop.as_bytes());
        }
        assert_eq!(Advert::from_txt_record(&record, 7400).unwrap(), a);
        // A value that is not UTF-8 names its field, as for a resolved service.
        let mut bad = b"\x05pv=\xff\xfe".to_vec();
        bad.extend_from_slice(&record);
        assert_eq!(Advert::from_txt_record(&bad, 7400).unwrap_err().field(), "pv");
        assert_eq!(Advert::from_txt_record(b"", 7400).unwrap_err(), TxtError::Missing { field: "id" });
    }

    #[test]
    fn unknown_keys_are_ignored_and_the_first_duplicate_wins() {
        let a = advert();
        let mut txt = a.to_txt();
        txt.push(("future".into(), "whatever".into()));
        txt.push(("pv".into(), "not a number".into()));
        txt.insert(0, ("ROLE".into(), "pc".into()));
        let b = Advert::from_txt(&txt, 7400).unwrap();
        assert_eq!(b, Advert { role: Role::Pc, ..a });
    }

    #[test]
    fn every_missing_field_is_named() {
        for field in ["id", "pv", "cl", "jp", "ram", "vram", "dev", "role", "ver"] {
            let txt: Vec<_> = advert().to_txt().into_iter().filter(|(k, _)| k != field).collect();
            assert_eq!(refused(&txt), TxtError::Missing { field }, "{field}");
        }
    }

    #[test]
    fn every_malformed_field_is_named() {
        let cases: &[(&str, &str)] = &[
            ("id", "zz"),
            ("id", &"zz".repeat(32)),
            ("id", &"ab".repeat(31)),
            ("id", &"é".repeat(32)),
            ("id", ""),
            ("pv", "one"),
            ("pv", "-1"),
            ("pv", "+1"),
            ("pv", " 1"),
            ("pv", "4294967296"),
            ("cl", "abc"),
            ("cl", &"gg".repeat(16)),
            ("cl", "UNPAIRED"),
            ("jp", "70000"),
            ("jp", "0"),
            ("jp", ""),
            ("ram", "1e9"),
            ("ram", "18446744073709551616"),
            ("vram", "-5"),
            ("vram", "0x10"),
            ("role", "leader"),
            ("role", ""),
            ("dev", "a\nb"),
            ("ver", "1.0\u{7}"),
        ];
        for (field, value) in cases {
            let mut txt = advert().to_txt();
            set(&mut txt, field, value);
            let err = refused(&txt);
            assert_eq!(err.field(), *field, "{field}={value:?}: {err}");
            assert!(matches!(err, TxtError::Invalid { .. }), "{err:?}");
        }
        let err = Advert::from_txt(&advert().to_txt(), 0).unwrap_err();
        assert_eq!(err.field(), "port");
    }

    #[test]
    fn every_overlong_field_is_named() {
        let cases = [
            ("id", "a".repeat(65)),
            ("pv", "1".repeat(11)),
            ("cl", "c".repeat(33)),
            ("jp", "0".repeat(6)),
            ("ram", "1".repeat(21)),
            ("vram", "1".repeat(21)),
            ("dev", "d".repeat(101)),
            ("role", "hubb".into()),
            ("ver", "v".repeat(33)),
        ];
        for (field, value) in cases {
            let mut txt = advert().to_txt();
            set(&mut txt, field, &value);
            let err = refused(&txt);
            assert_eq!(err.field(), field, "{err}");
            assert!(err.to_string().contains("over the limit"), "{err}");
        }
        let mut txt = advert().to_txt();
        for i in 0..6 {
            txt.push((format!("x{i}"), "y".repeat(250)));
        }
        assert_eq!(refused(&txt).field(), "txt");
    }

    #[test]
    fn error_messages_quote_network_input_briefly() {
        let mut txt = advert().to_txt();
        set(&mut txt, "dev", &format!("{}\n{}", "x".repeat(60), "y".repeat(30)));
        let msg = refused(&txt).to_string();
        assert!(!msg.contains('\n') && msg.len() < 120, "{msg}");
    }

    #[test]
    fn encoding_truncates_to_the_limits_on_char_boundaries() {
        let a = Advert { devices: "é".repeat(300), version: "ü".repeat(40), ..advert() };
        let txt = a.to_txt();
        for (k, v) in &txt {
            assert!(k.len() + 1 + v.len() <= MAX_PROPERTY_BYTES, "{k}");
        }
        let total: usize = txt.iter().map(|(k, v)| 2 + k.len() + v.len()).sum();
        assert!(total <= MAX_TXT_BYTES);
        let b = Advert::from_txt(&txt, 7400).unwrap();
        assert_eq!(b.devices, "é".repeat(50));
        assert_eq!(b.version, "ü".repeat(16));
        let odd = Advert { devices: "x".repeat(99) + "é", version: "tab\there".into(), ..advert() };
        let b = Advert::from_txt(&odd.to_txt(), 7400).unwrap();
        assert_eq!(b.devices, "x".repeat(99));
        assert_eq!(b.version, "tab here");
    }

    #[test]
    fn advert_from_inventory() {
        let inv = NodeInventory {
            cpu_cores: 8,
            ram_total_bytes: 32 << 30,
            ram_available_bytes: 20 << 30,
            shoal_version: "0.1.0-dev+a-very-long-build-suffix-here".into(),
            ..Default::default()
        };
        let a = Advert::new(NodeId([1; 32]), None, Role::Pc, 1000, 1001, &inv);
        assert_eq!((a.ram_available, a.vram_free, a.devices.as_str()), (20 << 30, 0, "8c/32G"));
        assert_eq!(a.version.len(), MAX_VERSION_BYTES);
        assert_eq!(Advert::from_txt(&a.to_txt(), 1000).unwrap(), a);
    }

    #[test]
    fn material_differences() {
        let a = advert();
        assert!(!a.differs_materially(&a.clone()));
        let changed = [
            Advert { cluster: None, ..a.clone() },
            Advert { role: Role::Pc, ..a.clone() },
            Advert { port: 1, ..a.clone() },
            Advert { join_port: 1, ..a.clone() },
            Advert { protocol: 2, ..a.clone() },
            Advert { node: NodeId([1; 32]), ..a.clone() },
            Advert { devices: "other".into(), ..a.clone() },
            Advert { version: "0.2.0".into(), ..a.clone() },
            // 24 GiB RAM: 600 MiB is under 10% but over 512 MiB.
            Advert { ram_available: a.ram_available - (600 << 20), ..a.clone() },
            Advert { vram_free: a.vram_free + (600 << 20), ..a.clone() },
        ];
        for b in &changed {
            assert!(a.differs_materially(b), "{b:?}");
        }
        let same = [
            Advert { ram_available: a.ram_available - (500 << 20), ..a.clone() },
            Advert { vram_free: a.vram_free + (500 << 20), ..a.clone() },
        ];
        for b in &same {
            assert!(!a.differs_materially(b), "{b:?}");
        }
        // 1 GiB of VRAM: 200 MiB is over 10% though under 512 MiB.
        let small = Advert { vram_free: 1 << 30, ..a.clone() };
        assert!(small.differs_materially(&Advert { vram_free: (1 << 30) - (200 << 20), ..a.clone() }));
        assert!(!small.differs_materially(&Advert { vram_free: (1 << 30) - (100 << 20), ..a.clone() }));
        let none = Advert { vram_free: 0, ..a.clone() };
        assert!(none.differs_materially(&Advert { vram_free: 1, ..a.clone() }));
        assert!(!none.differs_materially(&none.clone()));
    }

    #[test]
    fn interface_filter_defaults() {
        let f = InterfaceFilter::default();
        for name in ["eth0", "enp3s0", "wlan0", "wlp2s0", "en0", "Ethernet", "Wi-Fi", "v0"] {
            assert!(f.permits(name), "{name}");
        }
        for name in ["docker0", "br-abc123", "virbr0", "vEthernet (WSL)", "lo", "lo0", "Loopback Pseudo-Interface 1"] {
            assert!(!f.permits(name), "{name}");
        }
        assert!(!f.permits_interface("weird-loopback", true));
        let f = InterfaceFilter { allow: vec![], deny: vec!["wlan*".into(), "eth1".into()] };
        assert!(!f.permits("wlan0") && !f.permits("eth1") && !f.permits("docker0"));
        assert!(f.permits("eth0") && f.permits("eth10"));
    }

    #[test]
    fn interface_filter_allow_list() {
        let f = InterfaceFilter { allow: vec!["v*".into(), "eth0".into()], deny: vec![] };
        assert!(f.permits("v0") && f.permits("v12") && f.permits("veth3") && f.permits("vEthernet (WSL)"));
        assert!(f.permits("eth0"));
        assert!(!f.permits("eth01") && !f.permits("lo") && !f.permits("wlan0") && !f.permits("xv0"));
        let f = InterfaceFilter::loopback();
        assert!(f.permits("lo") && f.permits_interface("lo", true));
        assert!(!f.permits("eth0") && !f.permits("lo0") && !f.permits("docker0"));
        let f = InterfaceFilter { allow: vec!["*".into()], deny: vec!["docker*".into()] };
        assert!(f.permits("lo") && f.permits("virbr0") && !f.permits("docker0"));
        let f = InterfaceFilter { allow: vec!["docker0".into()], deny: vec![] };
        assert!(f.permits("docker0"), "an explicit allow overrides the default denials");
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn tracker_reports_changes_once_and_never_itself() {
        let own = advert();
        let own_name = format!("{}.{SERVICE_TYPE}", instance_name(&own.node));
        let mut t = Tracker::new(own.node, own_name.clone());
        assert!(t.observe(&own_name.to_uppercase(), Ok(own.clone()), vec![ip("127.0.0.1")]).is_empty());

        let peer = Advert { node: NodeId([7; 32]), ..advert() };
        let name = format!("{}.{SERVICE_TYPE}", instance_name(&peer.node));
        let addrs = vec![ip("10.0.0.2")];
        let found = DiscoveryEvent::Found { advert: peer.clone(), addrs: addrs.clone() };
        assert_eq!(t.observe(&name, Ok(peer.clone()), addrs.clone()), [found]);
        assert!(t.observe(&name, Ok(peer.clone()), addrs.clone()).is_empty(), "unchanged: no event");
        let moved = Advert { cluster: None, ..peer.clone() };
        assert_eq!(t.observe(&name, Ok(moved.clone()), addrs.clone()).len(), 1);
        let more = vec![ip("10.0.0.2"), ip("fe80::1")];
        assert_eq!(t.observe(&name, Ok(moved.clone()), more.clone()).len(), 1);
        assert!(t.observe(&name, Ok(moved), vec![]).is_empty(), "no address: nothing to report");
        // A bad record for a known instance is ignored; the peer stays.
        assert!(t.observe(&name, Err(TxtError::Missing { field: "pv" }), more).is_empty());
        assert_eq!(t.removed(&name), [DiscoveryEvent::Lost { node: peer.node }]);
        assert!(t.removed(&name).is_empty(), "lost once");
        assert!(t.removed("stranger._shoal._udp.local.").is_empty());

        // Someone else advertising our id is not us, and not a peer either.
        let impostor = "0000000000000000._shoal._udp.local.";
        assert!(t.observe(impostor, Ok(own), vec![ip("10.0.0.9")]).is_empty());
    }

    #[test]
    fn tracker_warns_once_per_bad_record() {
        let mut t = Tracker::new(NodeId([1; 32]), "me._shoal._udp.local.".into());
        let name = "rogue._shoal._udp.local.";
        for _ in 0..3 {
            assert!(t.observe(name, Err(TxtError::Missing { field: "pv" }), vec![ip("10.0.0.3")]).is_empty());
        }
        assert_eq!(t.bad.len(), 1);
        assert!(t.removed(name).is_empty());
        assert!(t.bad.is_empty());
        for i in 0..(MAX_REMEMBERED_BAD + 5) {
            t.observe(&format!("r{i}.x"), Err(TxtError::Missing { field: "id" }), vec![]);
        }
        assert!(t.bad.len() <= MAX_REMEMBERED_BAD);
    }

    #[test]
    fn non_utf8_values_name_the_field() {
        let mut txt = TxtProperties::from(&b"\x05id=ab\x05pv=\xff\xfe\x03x=\xff"[..]);
        assert_eq!(txt_strings(&txt).unwrap_err().field(), "pv");
        txt = TxtProperties::from(&b"\x05id=ab\x04flag\x03x=\xff"[..]);
        assert_eq!(txt_strings(&txt).unwrap(), [("id".to_string(), "ab".to_string()), ("flag".into(), "".into())]);
    }
}
