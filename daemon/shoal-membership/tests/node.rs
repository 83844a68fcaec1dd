//! Cluster nodes in this process on 127.0.0.1, with real QUIC and real mDNS on `lo`:
//! approval from the CLI, pairing with a code (wrong codes fail and are rate-limited),
//! strangers and revoked keys refused, garbage on the membership protocol ignored.

use shoal_membership::node::{self, CreatePolicy, NodeConfig, NodeError};
use shoal_membership::wire::{self, AdminRequest, AdminResponse, ClusterStatus, JoinRequest, JoinResponse};
use shoal_membership::Config;
use shoal_net::discovery::InterfaceFilter;
use shoal_net::{alpn, Identity, Node, TransportOptions, TrustedKeys};
use shoal_types::{NodeId, NodeInventory, Role};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

struct TestNode {
    dir: PathBuf,
    id: NodeId,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), NodeError>>,
}

fn start(dir: &Path, name: &str, create: CreatePolicy) -> TestNode {
    start_with(dir, name, create, None)
}

fn start_with(dir: &Path, name: &str, create: CreatePolicy, calibrator: Option<node::Calibrator>) -> TestNode {
    start_cfg(dir, name, create, |cfg| cfg.calibrator = calibrator)
}

fn start_cfg(dir: &Path, name: &str, create: CreatePolicy, tweak: impl FnOnce(&mut NodeConfig)) -> TestNode {
    let identity = Arc::new(Identity::load_or_create(dir).unwrap());
    let mut cfg = NodeConfig {
        data_dir: dir.to_path_buf(),
        listen: "127.0.0.1:0".parse().unwrap(),
        join_listen: "127.0.0.1:0".parse().unwrap(),
        name: name.into(),
        role: Role::Pc,
        interfaces: InterfaceFilter::loopback(),
        web_port: None,
        create,
        accept: None,
        join_token: None,
        timing: Config::default(),
        transport: TransportOptions::default(),
        calibrator: None,
    };
    tweak(&mut cfg);
    let inventory = NodeInventory { ram_total_bytes: 8 << 30, ram_available_bytes: 4 << 30, ..Default::default() };
    let (_keep, rx) = tokio::sync::watch::channel(inventory);
    let (stop, stopped) = oneshot::channel::<()>();
    let id = identity.id();
    let task = tokio::spawn(async move {
        let _keep = _keep;
        node::run(cfg, identity, rx, async {
            let _ = stopped.await;
        })
        .await
    });
    TestNode { dir: dir.to_path_buf(), id, stop: Some(stop), task }
}

impl TestNode {
    async fn ask(&self, req: AdminRequest) -> AdminResponse {
        let identity = Arc::new(Identity::load_or_create(&self.dir).unwrap());
        // The node writes its endpoint file once its endpoints are up.
        let t0 = Instant::now();
        loop {
            match node::admin(&self.dir, identity.clone(), &req).await {
                Ok(answer) => return answer,
                Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("admin request: {e}"),
            }
        }
    }

    async fn status(&self) -> ClusterStatus {
        match self.ask(AdminRequest::Status).await {
            AdminResponse::Status(s) => *s,
            other => panic!("status: {other:?}"),
        }
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.await.unwrap().unwrap();
    }
}

/// Poll `f` until it returns `Some`, at most `secs`.
async fn wait_for<T, F, Fut>(what: &str, secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let t0 = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what}: not within {secs} s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A client endpoint on loopback holding `key`, trusting only `target`.
fn client_of(key: Identity, target: NodeId) -> Node {
    Node::bind("127.0.0.1:0".parse().unwrap(), Arc::new(key), TrustedKeys::new([target]), &TransportOptions::default())
        .unwrap()
}

/// Whether a node holding `key` can open a membership connection to `target` and have
/// it stay open (a refused key fails in the handshake or is closed right after).
async fn can_connect(key: Identity, target: &ClusterStatus) -> bool {
    let addr: SocketAddr = target.addr.parse().unwrap();
    let client = client_of(key, target.node);
    let Ok(conn) = client.connect(addr, target.node, alpn::MEMBERSHIP).await else { return false };
    tokio::time::timeout(Duration::from_secs(2), conn.closed()).await.is_err()
}

fn key_of(dir: &Path) -> Identity {
    Identity::load_or_create(dir).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_join_by_approval_and_by_code_and_strangers_stay_out() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs: Vec<PathBuf> = ["a", "b", "c"].iter().map(|n| tmp.path().join(n)).collect();
    let a = start(&dirs[0], "a", CreatePolicy::Now);
    // B can "calibrate": slowly (to see that a second request is refused meanwhile),
    // giving a made-up profile; the real one is the binary's (tested there).
    let calibrator = node::Calibrator(Arc::new(|job: &node::CalibrationJob| {
        std::thread::sleep(Duration::from_millis(500));
        let name = job.model.file_name().unwrap().to_string_lossy().into_owned();
        Ok((format!("profile/test/{name}"), serde_json::json!({ "tokens": job.tokens })))
    }));
    let b = start_with(&dirs[1], "b", CreatePolicy::Never, Some(calibrator));
    let c = start(&dirs[2], "c", CreatePolicy::Never);

    // A created a cluster; B and C are discovered, verified and listed as pending.
    let pending = wait_for("B and C pending at A", 15, || async {
        let s = a.status().await;
        let ids: Vec<NodeId> = s.pending.iter().map(|p| p.node).collect();
        (ids.contains(&b.id) && ids.contains(&c.id)).then_some(s)
    })
    .await;
    let cluster = pending.cluster.expect("A has a cluster");
    assert_eq!(b.status().await.role, "unpaired");

    // An approval alone does not adopt B: its owner has not agreed to that cluster.
    let prefix = b.id.to_string()[..10].to_string();
    match a.ask(AdminRequest::Approve { node: prefix.clone() }).await {
        AdminResponse::Error(e) => assert!(e.contains("--accept"), "{e}"),
        other => panic!("B was adopted without its owner: {other:?}"),
    }
    assert_eq!(b.status().await.role, "unpaired");
    // B's owner agrees to an approval from A, named by A's node id (a cluster id is
    // public: anyone on the LAN could claim it); then the approval from the CLI (an id
    // prefix is enough) takes.
    // (A's advert with its cluster may reach B a moment after B's reached A; other
    // tests' clusters on `lo` may be listed too.)
    wait_for("A's cluster seen at B", 15, || async {
        b.status().await.lan_clusters.iter().any(|(c, _)| *c == cluster).then_some(())
    })
    .await;
    match b.ask(AdminRequest::Accept { member: a.id.to_string()[..12].into() }).await {
        AdminResponse::Error(e) => assert!(e.contains("16"), "{e}"),
        other => panic!("a short prefix was taken: {other:?}"),
    }
    match b.ask(AdminRequest::Accept { member: cluster.to_string()[..16].into() }).await {
        AdminResponse::Error(e) => assert!(e.contains("cluster's id"), "{e}"),
        other => panic!("a cluster id was taken: {other:?}"),
    }
    match b.ask(AdminRequest::Accept { member: a.id.to_string()[..16].into() }).await {
        AdminResponse::Ok(text) => {
            assert!(text.contains(&a.id.to_string()) && text.contains(&cluster.to_string()), "{text}")
        }
        other => panic!("accept: {other:?}"),
    }
    assert_eq!(b.status().await.accepting.as_deref(), Some(&a.id.to_string()[..16]));
    // The review's F2: while B is armed, a stranger (a fresh key, never approved) sends
    // a welcome into a state of its making with the real cluster id, listing B and
    // itself. Refused: the welcome is not from the member B's owner named.
    let stranger = Arc::new(Identity::generate().unwrap());
    let member =
        |id: NodeId| shoal_membership::Member { id, name: "hub".into(), role: Role::Hub, memory_bytes: 1 << 40 };
    let mut forged = shoal_membership::ClusterState::create(cluster, member(stranger.id()));
    forged.apply(&shoal_membership::Change::AddMember(member(b.id))).unwrap();
    forged.version = shoal_membership::Version { term: 1, index: 2 };
    let open = Node::bind_open("127.0.0.1:0".parse().unwrap(), stranger.clone(), &TransportOptions::default()).unwrap();
    let join_addr: SocketAddr = b.status().await.join_addr.parse().unwrap();
    let conn = open.connect(join_addr, b.id, alpn::JOIN).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    wire::write_msg(&mut send, &JoinRequest::Welcome { state: Box::new(forged) }).await.unwrap();
    match wire::read_msg::<JoinResponse>(&mut recv).await.unwrap() {
        Some(JoinResponse::Error(e)) => assert!(e.contains("--accept"), "{e}"),
        other => panic!("a stranger's welcome with the real cluster id was taken: {other:?}"),
    }
    let sb = b.status().await;
    assert_eq!((sb.cluster, sb.role.as_str()), (None, "unpaired"), "the stranger adopted B");
    // Gone: on loopback every node shares one source address, and a join connection
    // left open holds one of its places at B's join endpoint.
    conn.close(0u32.into(), b"done");
    drop(open);
    match a.ask(AdminRequest::Approve { node: prefix }).await {
        AdminResponse::Ok(text) => assert!(text.contains(&b.id.to_string())),
        other => panic!("approve: {other:?}"),
    }
    wait_for("B in the cluster", 10, || async { (b.status().await.cluster == Some(cluster)).then_some(()) }).await;

    // Pairing: a code from B; a wrong one fails, a retry at once is refused, the right
    // one after the pause joins C.
    let code = match b.ask(AdminRequest::Pair).await {
        AdminResponse::Code { code, valid_s } => {
            assert!(valid_s > 60);
            code
        }
        other => panic!("pair: {other:?}"),
    };
    let wrong = if code == "0000-0000" { "1111-1111" } else { "0000-0000" };
    match c.ask(AdminRequest::Join { code: wrong.into() }).await {
        AdminResponse::Error(e) => {
            assert!(e.contains("wrong"), "{e}");
            assert!(!e.contains(&code) && !e.contains(&code.replace('-', "")), "the error reveals the code: {e}");
        }
        other => panic!("wrong code accepted: {other:?}"),
    }
    match c.ask(AdminRequest::Join { code: code.clone() }).await {
        AdminResponse::Error(e) => assert!(e.contains("try again"), "{e}"),
        other => panic!("no rate limit: {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // The pause lifts (under a loaded machine the member may still be closing the
    // wrong exchange a moment longer: a "try again" then says how long, and is heeded).
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        match c.ask(AdminRequest::Join { code: code.clone() }).await {
            AdminResponse::Ok(text) => {
                assert!(text.contains(&cluster.to_string()));
                break;
            }
            AdminResponse::Error(e) if e.contains("try again") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            other => panic!("right code refused: {other:?}"),
        }
    }

    // One leader, known to all, every member alive everywhere.
    let nodes = [&a, &b, &c];
    wait_for("three members, one leader", 15, || async {
        let mut leaders = Vec::new();
        for n in nodes {
            let s = n.status().await;
            let all_alive =
                s.members.len() == 3 && s.members.iter().all(|m| m.state == shoal_membership::Liveness::Alive);
            if !all_alive || s.cluster != Some(cluster) {
                return None;
            }
            leaders.push(s.leader?);
        }
        leaders.windows(2).all(|w| w[0] == w[1]).then_some(())
    })
    .await;
    let sa = a.status().await;

    // A stranger: refused on the main endpoint; on the join endpoint it learns only
    // public facts, and cannot push a cluster state onto a member.
    assert!(!can_connect(Identity::generate().unwrap(), &sa).await, "a stranger's key got in");
    let stranger = Node::bind_open(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(Identity::generate().unwrap()),
        &TransportOptions::default(),
    )
    .unwrap();
    let join_addr: SocketAddr = sa.join_addr.parse().unwrap();
    let conn = stranger.connect(join_addr, a.id, alpn::JOIN).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    wire::write_msg(&mut send, &JoinRequest::Hello).await.unwrap();
    match wire::read_msg::<JoinResponse>(&mut recv).await.unwrap() {
        Some(JoinResponse::Info(info)) => assert_eq!((info.node, info.cluster), (a.id, Some(cluster))),
        other => panic!("hello: {other:?}"),
    }
    let mut forged = shoal_membership::ClusterState::create(
        shoal_types::ClusterId([9; 16]),
        shoal_membership::Member { id: stranger.id(), name: "evil".into(), role: Role::Hub, memory_bytes: 1 },
    );
    forged
        .apply(&shoal_membership::Change::AddMember(shoal_membership::Member {
            id: a.id,
            name: "a".into(),
            role: Role::Pc,
            memory_bytes: 1,
        }))
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    wire::write_msg(&mut send, &JoinRequest::Welcome { state: Box::new(forged) }).await.unwrap();
    assert!(matches!(wire::read_msg::<JoinResponse>(&mut recv).await.unwrap(), Some(JoinResponse::Error(_))));
    assert_eq!(a.status().await.cluster, Some(cluster));

    // Garbage from a member on the membership protocol is logged and ignored.
    let client = client_of(key_of(&dirs[1]), a.id);
    let conn = client.connect(sa.addr.parse().unwrap(), a.id, alpn::MEMBERSHIP).await.unwrap();
    for junk in [&b"\x00\x00\x00\x05hello"[..], b"\xff\xff\xff\xff", b"\x00\x00\x00\x02{}", b"\x00\x00", b""] {
        let mut s = conn.open_uni().await.unwrap();
        s.write_all(junk).await.unwrap();
        s.finish().unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = a.status().await;
    assert_eq!(after.members.len(), 3);
    assert!(after.members.iter().all(|m| m.state == shoal_membership::Liveness::Alive));

    // Another member may read and measure through A's admin protocol, not administer.
    let as_b = |req: AdminRequest| {
        let addr: SocketAddr = sa.addr.parse().unwrap();
        let key = Arc::new(key_of(&dirs[1]));
        async move { node::admin_at(addr, a.id, key, &req).await.unwrap() }
    };
    assert!(matches!(as_b(AdminRequest::Status).await, AdminResponse::Status(_)));
    for req in [AdminRequest::Pair, AdminRequest::Remove { node: c.id.to_string() }] {
        match as_b(req).await {
            AdminResponse::Error(e) => assert!(e.contains("owner"), "{e}"),
            other => panic!("a member administered another: {other:?}"),
        }
    }
    let gguf = tmp.path().join("m.gguf");
    std::fs::write(&gguf, b"GGUF").unwrap();
    let calibrate = || AdminRequest::Calibrate { model: gguf.display().to_string(), tokens: 8, threads: 1 };
    match as_b(calibrate()).await {
        AdminResponse::Error(e) => assert!(e.contains("cannot calibrate"), "{e}"),
        other => panic!("A has no calibrator: {other:?}"),
    }
    // Requests out of bounds are refused before anything runs: a file that is not a
    // regular .gguf file (a pipe would block the node), too many steps or threads.
    let fifo = tmp.path().join("pipe.gguf");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for (model, tokens, threads, want) in [
        (fifo.display().to_string(), 8, 1, "no such .gguf"),
        (dirs[0].join("node.key").display().to_string(), 8, 1, "no such .gguf"),
        (gguf.display().to_string(), 100_000, 1, "steps"),
        (gguf.display().to_string(), 8, 100_000, "threads"),
    ] {
        match b.ask(AdminRequest::Calibrate { model, tokens, threads }).await {
            AdminResponse::Error(e) => assert!(e.contains(want), "{e}"),
            other => panic!("a bad calibration was taken: {other:?}"),
        }
    }
    match a.ask(AdminRequest::ProbeLinks { frame_bytes: 0 }).await {
        AdminResponse::Error(e) => assert!(e.contains("out of bounds"), "{e}"),
        other => panic!("a probe of empty frames was taken: {other:?}"),
    }
    // B calibrates (one at a time) and the profile is replicated.
    let (first, second) = tokio::join!(b.ask(calibrate()), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        b.ask(calibrate()).await
    });
    assert!(matches!(first, AdminResponse::Ok(_)), "{first:?}");
    assert!(matches!(&second, AdminResponse::Error(e) if e.contains("already")), "{second:?}");
    // A probes its links to B and C; every member then holds the measurements.
    match a.ask(AdminRequest::ProbeLinks { frame_bytes: 2304 }).await {
        AdminResponse::Ok(_) => {}
        other => panic!("probe links: {other:?}"),
    }
    let entries = wait_for("links and profile replicated to C", 10, || async {
        match c.ask(AdminRequest::Entries { prefix: String::new() }).await {
            AdminResponse::Entries(e) if e.len() >= 2 => Some(e),
            _ => None,
        }
    })
    .await;
    assert_eq!(entries["profile/test/m.gguf"]["tokens"], 8);
    let links: node::LinksEntry = serde_json::from_value(entries[&format!("links/{}", a.id)].clone()).unwrap();
    assert_eq!(links.frame_bytes, 2304);
    for peer in [b.id, c.id] {
        let m = &links.peers[&peer.to_string()];
        assert!(m.frame_ms > 0.0 && m.mbit_per_s > 0.0 && m.samples > 0, "{m:?}");
    }

    // A connection C holds open from before (an admin one) is closed when C is removed.
    let c_client = client_of(key_of(&dirs[2]), a.id);
    let held = c_client.connect(sa.addr.parse().unwrap(), a.id, alpn::ADMIN).await.unwrap();
    // Removing C revokes its key everywhere: C is told and falls back to unpaired, and
    // its key no longer opens a connection to A.
    match a.ask(AdminRequest::Remove { node: c.id.to_string() }).await {
        AdminResponse::Ok(text) => assert!(text.contains("revoked")),
        other => panic!("remove: {other:?}"),
    }
    wait_for("C unpaired", 10, || async { (c.status().await.role == "unpaired").then_some(()) }).await;
    tokio::time::timeout(Duration::from_secs(10), held.closed())
        .await
        .expect("the removed member's connection stays open");
    assert!(!can_connect(key_of(&dirs[2]), &sa).await, "a revoked key got in");
    assert!(can_connect(key_of(&dirs[1]), &sa).await, "a member's key was refused");
    let sb = b.status().await;
    assert!(sb.members.iter().all(|m| m.node != c.id));

    for n in [a, b, c] {
        n.stop().await;
    }
}

/// Poll until `node` lists `want` members, all alive, with one leader known.
async fn formed(nodes: &[&TestNode], want: usize) {
    wait_for("members formed", 20, || async {
        let mut leaders = Vec::new();
        for n in nodes {
            let s = n.status().await;
            let alive = s.members.iter().filter(|m| m.state == shoal_membership::Liveness::Alive).count();
            if s.members.len() != want || alive != want {
                return None;
            }
            leaders.push(s.leader?);
        }
        leaders.windows(2).all(|w| w[0] == w[1]).then_some(())
    })
    .await
}

/// Send one membership message to `target` with `key`, as a member would.
async fn send_membership(key: Identity, target: &ClusterStatus, msg: &shoal_membership::Msg) {
    let client = client_of(key, target.node);
    let conn = client.connect(target.addr.parse().unwrap(), target.node, alpn::MEMBERSHIP).await.unwrap();
    let mut s = conn.open_uni().await.unwrap();
    wire::write_msg(&mut s, msg).await.unwrap();
    s.finish().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_join_once_forged_notices_change_nothing_and_members_leave_or_reset() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let a = start(&dir("a"), "a", CreatePolicy::Now);
    let cluster = wait_for("A's cluster", 10, || async { a.status().await.cluster }).await;

    // A join token made on A admits C, started with it, by itself; a token text that is
    // not one is refused with the reason.
    match a.ask(AdminRequest::Token { valid_s: 0 }).await {
        AdminResponse::Error(e) => assert!(e.contains("at least"), "{e}"),
        other => panic!("a token valid 0 s: {other:?}"),
    }
    let token = match a.ask(AdminRequest::Token { valid_s: 600 }).await {
        AdminResponse::Code { code, .. } => code,
        other => panic!("token: {other:?}"),
    };
    assert!(token.contains(&cluster.to_string()));
    assert_eq!(a.status().await.tokens, 1);
    let parsed: shoal_membership::token::JoinToken = token.parse().unwrap();
    let c = start_cfg(&dir("c"), "c", CreatePolicy::Never, |cfg| cfg.join_token = Some(parsed.clone()));
    wait_for("C joined with the token", 20, || async { (c.status().await.cluster == Some(cluster)).then_some(()) })
        .await;
    assert_eq!(a.status().await.tokens, 0, "the token was not used up");
    // The same token again: D never gets in, and its status says why.
    let d = start_cfg(&dir("d"), "d", CreatePolicy::Never, |cfg| cfg.join_token = Some(parsed));
    let why = wait_for("D's token refused", 20, || async {
        let s = d.status().await;
        assert_eq!(s.cluster, None, "a used token admitted a second node");
        s.join_token.filter(|t| t.contains("holds this token") || t.contains("refused"))
    })
    .await;
    eprintln!("D with a used token: {why}");

    // B joins with a pairing code: three members.
    let code = match a.ask(AdminRequest::Pair).await {
        AdminResponse::Code { code, .. } => code,
        other => panic!("pair: {other:?}"),
    };
    let b = start(&dir("b"), "b", CreatePolicy::Never);
    wait_for("B joined with the code", 20, || async {
        match b.ask(AdminRequest::Join { code: code.clone() }).await {
            AdminResponse::Ok(_) => Some(()),
            AdminResponse::Error(e) if e.contains("no member") => None,
            other => panic!("join: {other:?}"),
        }
    })
    .await;
    formed(&[&a, &b, &c], 3).await;

    // A forged mDNS advert: B's id and the cluster id, another address. It must not
    // take the place of the address A reaches B at, nor make B unreachable.
    let b_addr = a.status().await.members.iter().find(|m| m.node == b.id).and_then(|m| m.addr.clone());
    let inventory = NodeInventory { ram_total_bytes: 1 << 30, ..Default::default() };
    let forged_advert = shoal_net::discovery::Advert::new(b.id, Some(cluster), Role::Hub, 9, 9, &inventory);
    let (liar, _events) = shoal_net::discovery::Discovery::start(forged_advert, &InterfaceFilter::loopback()).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    formed(&[&a, &b, &c], 3).await;
    let now_addr = a.status().await.members.iter().find(|m| m.node == b.id).and_then(|m| m.addr.clone());
    assert_eq!(now_addr, b_addr, "a forged advert replaced a member's address");
    // Forged adverts of A and C too, naming another join port: B's leave below asks
    // them on their join endpoints, which the forgeries must not hide.
    let liars: Vec<_> = [a.id, c.id]
        .into_iter()
        .map(|id| {
            let advert = shoal_net::discovery::Advert::new(id, Some(cluster), Role::Hub, 9, 9, &inventory);
            shoal_net::discovery::Discovery::start(advert, &InterfaceFilter::loopback()).unwrap().0
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Forged notices from a member that is not the leader change nothing.
    let sa = a.status().await;
    let leader = sa.leader.unwrap();
    let ids = [(a.id, &a), (b.id, &b), (c.id, &c)];
    let (forger_id, forger) = ids.iter().find(|(id, _)| *id != leader).map(|(id, n)| (*id, *n)).unwrap();
    let (victim_id, victim) =
        ids.iter().find(|(id, _)| *id != leader && *id != forger_id).map(|(id, n)| (*id, *n)).unwrap();
    let sv = victim.status().await;
    let member = |id: NodeId| shoal_membership::Member { id, name: "x".into(), role: Role::Pc, memory_bytes: 1 };
    // A removal notice naming the victim removed, on its join endpoint.
    let mut without_victim = shoal_membership::ClusterState::create(cluster, member(a.id));
    for id in [b.id, c.id] {
        let _ = without_victim.apply(&shoal_membership::Change::AddMember(member(id)));
    }
    without_victim.apply(&shoal_membership::Change::RemoveMember(victim_id)).unwrap();
    without_victim.version = shoal_membership::Version { term: sv.term, index: 1000 };
    let forger_key = Arc::new(key_of(&forger.dir));
    let open =
        Node::bind_open("127.0.0.1:0".parse().unwrap(), forger_key.clone(), &TransportOptions::default()).unwrap();
    let conn = open.connect(sv.join_addr.parse().unwrap(), victim_id, alpn::JOIN).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    wire::write_msg(&mut send, &JoinRequest::Revoked { state: Box::new(without_victim.clone()) }).await.unwrap();
    let _ = wire::read_msg::<JoinResponse>(&mut recv).await;
    // A cluster state from the forger, for the current term, adding a stranger.
    let mut with_stranger = without_victim.clone();
    with_stranger.apply(&shoal_membership::Change::AddMember(member(victim_id))).unwrap();
    let stranger = NodeId([0x66; 32]);
    with_stranger.apply(&shoal_membership::Change::AddMember(member(stranger))).unwrap();
    let forged = shoal_membership::Msg::State { term: sv.term, state: Box::new(with_stranger) };
    send_membership(key_of(&forger.dir), &sv, &forged).await;
    // The same as the leader of a newer term (the real leader is alive), and terms at
    // the end of the counter.
    let shoal_membership::Msg::State { state, .. } = forged else { unreachable!() };
    for term in [sv.term + 1, u64::MAX] {
        let newer = shoal_membership::Msg::State { term, state: state.clone() };
        send_membership(key_of(&forger.dir), &sv, &newer).await;
        let beat = shoal_membership::Msg::Beat { term, leader: true, version: state.version };
        send_membership(key_of(&forger.dir), &sv, &beat).await;
    }
    assert_eq!(victim.status().await.term, sv.term, "a forged term was taken");
    // The victim asks the members about the removal (a few rounds) and keeps its place.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let after = victim.status().await;
    assert_eq!(after.cluster, Some(cluster), "a forged removal notice removed a member");
    assert_eq!(after.members.len(), 3, "a forged state was taken: {:?}", after.members);
    assert!(after.members.iter().all(|m| m.node != stranger));
    formed(&[&a, &b, &c], 3).await;

    // B leaves cleanly: unpaired, removed everywhere, its key refused.
    match b.ask(AdminRequest::Leave).await {
        AdminResponse::Ok(text) => assert!(text.contains("unpaired"), "{text}"),
        other => panic!("leave: {other:?}"),
    }
    assert_eq!(b.status().await.role, "unpaired");
    wait_for("B removed at A", 10, || async { (a.status().await.members.len() == 2).then_some(()) }).await;
    assert!(!can_connect(key_of(&dir("b")), &a.status().await).await, "a member that left still gets in");
    liar.shutdown();
    for l in liars {
        l.shutdown();
    }

    // C forgets the cluster at once (its owner's reset).
    match c.ask(AdminRequest::Reset).await {
        AdminResponse::Ok(text) => assert!(text.contains("forgot"), "{text}"),
        other => panic!("reset: {other:?}"),
    }
    assert_eq!(c.status().await.role, "unpaired");
    // A stopped node is reset in its store; with a new key it becomes a new node.
    let d_id = d.id;
    d.stop().await;
    let text = node::reset_offline(&dir("d"), true).unwrap();
    assert!(text.contains("new key"), "{text}");
    assert_ne!(key_of(&dir("d")).id(), d_id);
    c.stop().await;
    // While a node runs, its store is locked: no reset behind its back.
    assert!(matches!(node::reset_offline(&dir("a"), false), Err(NodeError::Store(_))));
    for n in [a, b] {
        n.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_that_never_takes_effect_falls_back_to_unpaired() {
    // E's owner agreed to an approval from member F of cluster X; F welcomes E, but no
    // member of X ever talks to E: E must not stay in limbo.
    let tmp = tempfile::tempdir().unwrap();
    let x = shoal_types::ClusterId([0x5a; 16]);
    let f = Arc::new(Identity::generate().unwrap());
    let f_id = f.id().to_string();
    let e = start_cfg(&tmp.path().join("e"), "e", CreatePolicy::Never, |cfg| {
        cfg.accept = Some(f_id[..16].into());
        cfg.timing.confirm_ms = 2000;
    });
    let se = e.status().await;
    let fake = Node::bind_open("127.0.0.1:0".parse().unwrap(), f, &TransportOptions::default()).unwrap();
    let member = |id: NodeId| shoal_membership::Member { id, name: "x".into(), role: Role::Pc, memory_bytes: 1 };
    let mut state = shoal_membership::ClusterState::create(x, member(fake.id()));
    state.apply(&shoal_membership::Change::AddMember(member(e.id))).unwrap();
    let conn = fake.connect(se.join_addr.parse().unwrap(), e.id, alpn::JOIN).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    wire::write_msg(&mut send, &JoinRequest::Welcome { state: Box::new(state) }).await.unwrap();
    assert!(matches!(wire::read_msg::<JoinResponse>(&mut recv).await.unwrap(), Some(JoinResponse::Accepted)));
    assert_eq!(e.status().await.cluster, Some(x));
    wait_for("E back to unpaired", 15, || async { (e.status().await.role == "unpaired").then_some(()) }).await;
    e.stop().await;
}
