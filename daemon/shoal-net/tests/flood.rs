//! Handshake floods on loopback (`shoal_testnet::flood`): a plain UDP socket sends real,
//! well-formed QUIC v1 Initial packets (each a fresh connection id, a valid ClientHello,
//! 1200 bytes) and never answers, as a spoofed source cannot. Each one the endpoint admits holds a
//! handshake slot until it times out; a member must still get in meanwhile.

use shoal_net::{alpn, Identity, Node, NodeId, TransportOptions, TrustedKeys};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How many Initials a flood sends (bounded, loopback only).
const FLOOD: usize = 20_000;

/// Send [`FLOOD`] Initials to `to` from one loopback socket that never reads;
/// `started` fires after the first 2,000.
fn flood(to: SocketAddr, started: tokio::sync::oneshot::Sender<()>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut started = Some(started);
        let progress = |n: usize| {
            if n >= 2_000 {
                if let Some(s) = started.take() {
                    let _ = s.send(());
                }
            }
        };
        shoal_testnet::flood::send_initials(any(), &[to], FLOOD, alpn::MEMBERSHIP, progress).unwrap()
    })
}

fn any() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Run `n`'s accept loop; report each accepted peer.
fn serve(n: Node) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<NodeId>) {
    let addr = n.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some(acc) = n.accept().await {
            let _ = tx.send(acc.peer);
            held.push(acc.conn);
        }
    });
    (addr, rx)
}

/// Flood `server` and connect `client` to it meanwhile: it must get in.
async fn connect_through_a_flood(server: Node, client: Node, server_id: NodeId, proto: &[u8], what: &str) {
    let client_id = client.id();
    let (addr, mut accepted) = serve(server);
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let flooder = flood(addr, started_tx);
    started.await.unwrap();
    let t = Instant::now();
    // The time it took is printed; 30 s only catches a node the flood locked out (the
    // flood and the handshake share two cores with the rest of the suite).
    let conn = tokio::time::timeout(Duration::from_secs(30), client.connect(addr, server_id, proto))
        .await
        .unwrap_or_else(|_| panic!("{what}: no connection within 30 s of a flood"))
        .unwrap_or_else(|e| panic!("{what}: refused during a flood: {e}"));
    let took = t.elapsed();
    let peer = tokio::time::timeout(Duration::from_secs(10), accepted.recv()).await.unwrap();
    assert_eq!(peer, Some(client_id));
    let sent = tokio::task::spawn_blocking(move || flooder.join().unwrap()).await.unwrap();
    eprintln!("{what}: connected in {took:?} during a flood of {sent} QUIC Initials");
    drop(conn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_spoofed_initials_does_not_keep_a_member_out() {
    let (a, b) = (Identity::generate().unwrap(), Identity::generate().unwrap());
    let (ia, ib) = (a.id(), b.id());
    let opts = TransportOptions::default();
    let server = Node::bind(any(), Arc::new(a), TrustedKeys::new([ib]), &opts).unwrap();
    let client = Node::bind(any(), Arc::new(b), TrustedKeys::new([ia]), &opts).unwrap();
    connect_through_a_flood(server, client, ia, alpn::MEMBERSHIP, "main endpoint").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_spoofed_initials_does_not_close_the_join_endpoint() {
    let (a, b) = (Identity::generate().unwrap(), Identity::generate().unwrap());
    let ia = a.id();
    let opts = TransportOptions::default();
    let server = Node::bind_open(any(), Arc::new(a), &opts).unwrap();
    let client = Node::bind_open(any(), Arc::new(b), &opts).unwrap();
    connect_through_a_flood(server, client, ia, alpn::JOIN, "join endpoint").await;
}
