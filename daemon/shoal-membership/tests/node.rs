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
    let identity = Arc::new(Identity::load_or_create(dir).unwrap());
    let cfg = NodeConfig {
        data_dir: dir.to_path_buf(),
        listen: "127.0.0.1:0".parse().unwrap(),
        join_listen: "127.0.0.1:0".parse().unwrap(),
        name: name.into(),
        role: Role::Pc,
        interfaces: InterfaceFilter::loopback(),
        create,
        accept_approval: true,
        timing: Config::default(),
        transport: TransportOptions::default(),
        calibrator,
    };
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

/// Whether a node holding `key` can open a membership connection to `target` and have
/// it stay open (a refused key fails in the handshake or is closed right after).
async fn can_connect(key: Identity, target: &ClusterStatus) -> bool {
    let addr: SocketAddr = target.addr.parse().unwrap();
    let client = Node::bind(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(key),
        TrustedKeys::new([target.node]),
        &TransportOptions::default(),
    )
    .unwrap();
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

    // Approval from the CLI (an id prefix is enough).
    let prefix = b.id.to_string()[..10].to_string();
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
    match c.ask(AdminRequest::Join { code: code.clone() }).await {
        AdminResponse::Ok(text) => assert!(text.contains(&cluster.to_string())),
        other => panic!("right code refused: {other:?}"),
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
    let client = Node::bind(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(key_of(&dirs[1])),
        TrustedKeys::new([a.id]),
        &TransportOptions::default(),
    )
    .unwrap();
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
    let c_client = Node::bind(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(key_of(&dirs[2])),
        TrustedKeys::new([a.id]),
        &TransportOptions::default(),
    )
    .unwrap();
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
