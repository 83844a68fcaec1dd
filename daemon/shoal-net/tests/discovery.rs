//! mDNS discovery for real: two nodes in this process on loopback find each other, see
//! each other's updates and departures, and ignore a rogue advertiser; a hub answers
//! for `shoal.local` and a PC does not; three nodes on namespace hosts (child
//! processes, needs root) find each other across a bridge.

use mdns_sd::{HostnameResolutionEvent, IfKind, ServiceDaemon, ServiceInfo};
use shoal_net::{Advert, Discovery, DiscoveryEvent, Identity, InterfaceFilter, NodeId, PROTOCOL_VERSION, SERVICE_TYPE};
use shoal_types::{ClusterId, Role};
use std::collections::{HashMap, HashSet};
use std::io::BufRead;
use std::net::IpAddr;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::Receiver;

/// How long a peer may take to show up (or go away): an upper bound that only a hang
/// exceeds (mDNS answers within a second here, when the cores are not all busy).
const PATIENCE: Duration = Duration::from_secs(30);

/// Held by the tests that start discovery on loopback: every node browsing there warns
/// about the rogues, and the rogue test counts the warnings.
static LOOPBACK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Warnings logged anywhere in this process, one string per event.
fn warnings() -> &'static Mutex<Vec<String>> {
    static WARNINGS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    WARNINGS.get_or_init(|| {
        let _ = tracing::subscriber::set_global_default(WarnRecorder);
        Mutex::new(Vec::new())
    })
}

/// A tracing subscriber that keeps WARN and ERROR events (fields as `name=value`).
struct WarnRecorder;

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={:?} ", field.name(), value));
    }
}

impl tracing::Subscriber for WarnRecorder {
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        *meta.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        warnings().lock().unwrap().push(fields.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn advert(port: u16) -> Advert {
    Advert {
        node: Identity::generate().unwrap().id(),
        protocol: PROTOCOL_VERSION,
        cluster: None,
        port,
        join_port: port + 1,
        ram_available: 16 << 30,
        vram_free: 0,
        devices: "8c/32G".into(),
        role: Role::Pc,
        version: "test".into(),
    }
}

/// Events about `ours` (other Shoal nodes may be on this machine's loopback too).
struct Watch {
    name: &'static str,
    rx: Receiver<DiscoveryEvent>,
    me: NodeId,
    ours: HashSet<NodeId>,
    /// Node ids no event may be about.
    forbidden: HashSet<NodeId>,
}

impl Watch {
    /// Wait for an event about one of ours that `want` accepts; panic after PATIENCE.
    async fn until(&mut self, what: &str, want: impl Fn(&DiscoveryEvent) -> bool) -> (DiscoveryEvent, Duration) {
        let start = Instant::now();
        loop {
            let left = PATIENCE.checked_sub(start.elapsed()).unwrap_or_default();
            let event = match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) => panic!("{}: channel closed waiting for {what}", self.name),
                Err(_) => panic!("{}: no {what} within {PATIENCE:?}", self.name),
            };
            eprintln!("{} after {:?}: {event:?}", self.name, start.elapsed());
            let node = match &event {
                DiscoveryEvent::Found { advert, .. } => advert.node,
                DiscoveryEvent::Lost { node } => *node,
            };
            assert_ne!(node, self.me, "{}: reported itself: {event:?}", self.name);
            assert!(!self.forbidden.contains(&node), "{}: reported a rogue: {event:?}", self.name);
            if self.ours.contains(&node) && want(&event) {
                return (event, start.elapsed());
            }
        }
    }
}

fn found(event: &DiscoveryEvent) -> (&Advert, &[IpAddr]) {
    match event {
        DiscoveryEvent::Found { advert, addrs } => (advert, addrs),
        other => panic!("expected Found, got {other:?}"),
    }
}

/// A service registered straight with mdns-sd on loopback, with TXT that is not ours.
fn register_rogue(daemon: &ServiceDaemon, instance: &str, txt: &[(&str, &str)]) -> String {
    let info = ServiceInfo::new(SERVICE_TYPE, instance, &format!("{instance}.local."), (), 9999, txt)
        .unwrap()
        .enable_addr_auto();
    let fullname = info.get_fullname().to_string();
    daemon.register(info).unwrap();
    fullname
}

#[tokio::test]
async fn loopback_nodes_find_update_and_lose_each_other_and_ignore_rogues() {
    let _alone = LOOPBACK.lock().await;
    let warnings = warnings();
    let t0 = Instant::now();

    // Rogues first: garbage TXT, and a valid id with a missing `pv`.
    let rogue = ServiceDaemon::new().unwrap();
    rogue.disable_interface(IfKind::All).unwrap();
    rogue.enable_interface("lo").unwrap();
    let pid = std::process::id();
    let rogue_node = Identity::generate().unwrap().id();
    let rogue_id = rogue_node.to_string();
    let rogue_a = register_rogue(&rogue, &format!("rogue-{pid}-a"), &[("id", "zz"), ("role", "pc")]);
    let rogue_b = register_rogue(
        &rogue,
        &format!("rogue-{pid}-b"),
        &[
            ("id", &rogue_id),
            ("cl", "unpaired"),
            ("jp", "1"),
            ("ram", "1"),
            ("vram", "0"),
            ("dev", "x"),
            ("role", "pc"),
        ],
    );

    let (a, b) = (advert(17400), advert(17410));
    let (disc_a, rx_a) = Discovery::start(a.clone(), &InterfaceFilter::loopback()).unwrap();
    let (disc_b, rx_b) = Discovery::start(b.clone(), &InterfaceFilter::loopback()).unwrap();
    let ours: HashSet<NodeId> = [a.node, b.node].into();
    let forbidden: HashSet<NodeId> = [rogue_node].into();
    let mut watch_a = Watch { name: "a", rx: rx_a, me: a.node, ours: ours.clone(), forbidden: forbidden.clone() };
    let mut watch_b = Watch { name: "b", rx: rx_b, me: b.node, ours, forbidden };

    let (event, took_a) = watch_a.until("b found", |e| matches!(e, DiscoveryEvent::Found { .. })).await;
    let (advert_b, addrs) = found(&event);
    assert_eq!(advert_b, &b);
    assert!(addrs.contains(&IpAddr::from([127, 0, 0, 1])), "{addrs:?}");
    let (event, took_b) = watch_b.until("a found", |e| matches!(e, DiscoveryEvent::Found { .. })).await;
    let (advert_a, addrs) = found(&event);
    assert_eq!(advert_a, &a);
    assert!(addrs.contains(&IpAddr::from([127, 0, 0, 1])), "{addrs:?}");
    eprintln!("found each other: a after {took_a:?}, b after {took_b:?}");

    // A small change is kept but not re-registered; a material one is, and seen.
    assert!(!disc_b.update(Advert { ram_available: b.ram_available - (100 << 20), ..b.clone() }).unwrap());
    let b2 = Advert { cluster: Some(ClusterId([0x42; 16])), role: Role::Hub, ram_available: 4 << 30, ..b.clone() };
    assert!(disc_b.update(b2.clone()).unwrap());
    assert_eq!(disc_b.advert(), b2);
    let (event, took) = watch_a
        .until("b's update", |e| matches!(e, DiscoveryEvent::Found { advert, .. } if advert.cluster.is_some()))
        .await;
    assert_eq!(found(&event).0, &b2);
    eprintln!("update seen after {took:?}");
    assert!(matches!(
        disc_b.update(Advert { node: a.node, ..b2.clone() }),
        Err(shoal_net::DiscoveryError::OtherNode { .. })
    ));
    assert!(disc_b.update(Advert { join_port: 0, ..b2.clone() }).is_err(), "an advert that would not decode");

    // B leaves: A sees it go.
    let left = Instant::now();
    disc_b.shutdown();
    eprintln!("shutdown took {:?}", left.elapsed());
    let (event, took) = watch_a.until("b lost", |e| matches!(e, DiscoveryEvent::Lost { .. })).await;
    assert_eq!(event, DiscoveryEvent::Lost { node: b.node });
    eprintln!("lost seen after {took:?}");

    // Each node warned about each rogue exactly once.
    let logged = warnings.lock().unwrap().clone();
    for rogue_name in [&rogue_a, &rogue_b] {
        let about: Vec<&String> = logged.iter().filter(|w| w.contains(rogue_name.as_str())).collect();
        assert_eq!(about.len(), 2, "one warning per node about {rogue_name}: {logged:#?}");
    }
    assert!(logged.iter().any(|w| w.contains(&rogue_b) && w.contains("`pv` is missing")), "{logged:#?}");

    disc_a.shutdown();
    let _ = rogue.shutdown();
    eprintln!("whole test: {:?}", t0.elapsed());
}

/// The names of this process's threads (Linux: `/proc/self/task/*/comm`).
#[cfg(target_os = "linux")]
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

#[tokio::test]
async fn discovery_runs_without_a_runtime_and_stops_when_dropped() {
    let _alone = LOOPBACK.lock().await;
    let ad = advert(17420);
    let (disc, rx) =
        std::thread::spawn(move || Discovery::start(ad, &InterfaceFilter::loopback())).join().unwrap().unwrap();
    // Discovery's two threads: mdns-sd's daemon and the forwarder of its events (other
    // tests of this binary that start discovery hold LOOPBACK too, so these are ours).
    #[cfg(target_os = "linux")]
    let ours = |names: &[String]| names.iter().filter(|n| *n == "mDNS_daemon" || *n == "shoal-discovery").count();
    // (A thread names itself once it runs: until then it shows its parent's name.)
    #[cfg(target_os = "linux")]
    {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while ours(&thread_names()) < 2 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ours(&thread_names()), 2, "{:?}", thread_names());
    }
    drop(rx);
    drop(disc);
    // Both threads end (the drop waits for the daemon's shutdown; the forwarder ends
    // with its browse): none is left running after discovery is gone.
    #[cfg(target_os = "linux")]
    {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while ours(&thread_names()) > 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(ours(&thread_names()), 0, "threads left after the drop: {:?}", thread_names());
    }
}

/// The addresses `shoal.local.` resolves to, asked from a daemon of its own on loopback,
/// within `wait`; empty if nothing answered.
fn resolve_shoal_local(wait: Duration) -> Vec<IpAddr> {
    let resolver = ServiceDaemon::new().unwrap();
    resolver.disable_interface(IfKind::All).unwrap();
    resolver.enable_interface("lo").unwrap();
    let events = resolver.resolve_hostname(shoal_net::discovery::WEB_HOST, Some(wait.as_millis() as u64)).unwrap();
    let start = Instant::now();
    let mut found = Vec::new();
    while let Some(left) = wait.checked_sub(start.elapsed()) {
        match events.recv_timeout(left) {
            Ok(HostnameResolutionEvent::AddressesFound(_, addrs)) => {
                found.extend(addrs.iter().map(|a| a.to_ip_addr()));
                break;
            }
            Ok(HostnameResolutionEvent::SearchTimeout(_) | HostnameResolutionEvent::SearchStopped(_)) | Err(_) => break,
            Ok(_) => {}
        }
    }
    let _ = resolver.shutdown();
    found
}

#[tokio::test]
async fn a_hub_answers_for_shoal_local_and_a_pc_does_not() {
    // The same wait for both: what the hub answers within it, the PC must not.
    const WAIT: Duration = Duration::from_secs(5);
    let _alone = LOOPBACK.lock().await;
    let pc = Advert { role: Role::Pc, ..advert(17440) };
    let (pc, _rx) = Discovery::start(pc, &InterfaceFilter::loopback()).unwrap();
    assert!(!pc.advertise_web(11434).unwrap(), "a PC advertises no admin page");
    let t0 = Instant::now();
    let answered = tokio::task::spawn_blocking(move || resolve_shoal_local(WAIT)).await.unwrap();
    assert!(answered.is_empty(), "shoal.local answered with only a PC running: {answered:?}");
    eprintln!("no answer for shoal.local from a PC in {:?}", t0.elapsed());
    drop(pc);

    let hub = Advert { role: Role::Hub, ..advert(17450) };
    let (hub, _rx) = Discovery::start(hub, &InterfaceFilter::loopback()).unwrap();
    assert!(matches!(hub.advertise_web(0), Err(shoal_net::DiscoveryError::WebPort)));
    assert!(hub.advertise_web(11434).unwrap());
    let t0 = Instant::now();
    let answered = tokio::task::spawn_blocking(move || resolve_shoal_local(WAIT)).await.unwrap();
    eprintln!("shoal.local resolved to {answered:?} after {:?}", t0.elapsed());
    assert!(answered.contains(&IpAddr::from([127, 0, 0, 1])), "the hub's loopback address: {answered:?}");
    drop(hub);
}

/// Where cargo put the `mdns_probe` example: `target/<profile>/examples`, beside the
/// `deps` folder holding this test binary.
fn probe_binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let probe = profile_dir.join("examples").join(format!("mdns_probe{}", std::env::consts::EXE_SUFFIX));
    assert!(
        probe.exists(),
        "{} is missing: build it with `cargo build -p shoal-net --example mdns_probe` (plain `cargo test -p shoal-net` does)",
        probe.display()
    );
    probe
}

#[test]
fn namespace_hosts_find_each_other() {
    let Some(mut net) = shoal_testnet::precondition::namespaces("disc", 3) else { return };
    let probe = probe_binary();
    let (tx, rx) = std::sync::mpsc::channel::<(usize, String)>();
    for k in 0..net.len() {
        let mut child = net
            .command(k, &probe)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", probe.display()));
        let stdout = child.stdout.take().unwrap();
        net.adopt(child);
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send((k, line));
            }
        });
    }
    let start = Instant::now();
    let mut me: HashMap<usize, String> = HashMap::new();
    let mut seen: HashMap<usize, HashMap<String, String>> = HashMap::new();
    let complete = |me: &HashMap<usize, String>, seen: &HashMap<usize, HashMap<String, String>>| {
        me.len() == 3
            && (0..3).all(|k| (0..3).filter(|&j| j != k).all(|j| seen.get(&k).is_some_and(|s| s.contains_key(&me[&j]))))
    };
    while !complete(&me, &seen) {
        let left = PATIENCE.checked_sub(start.elapsed()).unwrap_or_default();
        let (k, line) = match rx.recv_timeout(left) {
            Ok(got) => got,
            Err(_) => panic!("hosts did not all find each other within {PATIENCE:?}: self {me:?}, seen {seen:?}"),
        };
        match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["self", id] => {
                me.insert(k, id.to_string());
            }
            ["found", id, addrs] => {
                seen.entry(k).or_default().insert(id.to_string(), addrs.to_string());
            }
            ["lost", _] => {}
            _ => panic!("host {k} printed {line:?}"),
        }
    }
    eprintln!("3 namespace hosts found each other within {:?}", start.elapsed());
    for k in 0..3 {
        assert!(!seen[&k].contains_key(&me[&k]), "host {k} found itself");
        for j in (0..3).filter(|&j| j != k) {
            let addrs = &seen[&k][&me[&j]];
            assert!(addrs.split(',').any(|a| a == net.addr(j).to_string()), "host {k} sees {j} at {addrs}");
        }
    }
}
