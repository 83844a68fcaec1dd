//! Real QUIC endpoints on 127.0.0.1: only pinned keys get through the handshake, the
//! dialled node must be the one meant, ALPN selects the protocol, frames cross.

use shoal_net::{alpn, Frame, FrameLimits, Identity, Node, NodeId, TransportOptions, TrustedKeys};
use std::sync::Arc;
use std::time::Duration;

fn node(trusted: &[NodeId], id: Identity) -> Node {
    Node::bind(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(id),
        TrustedKeys::new(trusted.iter().copied()),
        &TransportOptions::default(),
    )
    .unwrap()
}

/// A (server) and B (client) trusting each other, B connected to A over `control`:
/// both endpoints, B's connection and A's side of it.
async fn connected_pair() -> (Node, Node, quinn::Connection, shoal_net::endpoint::Accepted) {
    let (a, b, _) = ids();
    let (ia, ib) = (a.id(), b.id());
    let na = node(&[ib], a);
    let nb = node(&[ia], b);
    let addr = na.local_addr().unwrap();
    let (conn, acc) = tokio::join!(nb.connect(addr, ia, alpn::CONTROL), na.accept());
    let (conn, acc) = (conn.unwrap(), acc.unwrap());
    assert_eq!(acc.peer, ib);
    (na, nb, conn, acc)
}

fn ids() -> (Identity, Identity, Identity) {
    (Identity::generate().unwrap(), Identity::generate().unwrap(), Identity::generate().unwrap())
}

#[tokio::test]
async fn trusted_peers_connect_and_exchange_frames() {
    let (a, b, _) = ids();
    let (ia, ib) = (a.id(), b.id());
    let na = node(&[ib], a);
    let nb = node(&[ia], b);
    let addr_b = nb.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let acc = nb.accept().await.expect("a connection");
        assert_eq!(acc.peer, ia);
        assert_eq!(acc.alpn, alpn::PIPELINE);
        let mut rx = acc.conn.accept_uni().await.unwrap();
        let bytes = rx.read_to_end(1 << 20).await.unwrap();
        Frame::decode(&bytes, &FrameLimits { n_embd: 2, max_tokens: 4, max_message: 16 }).unwrap()
    });
    let conn = na.connect(addr_b, ib, alpn::PIPELINE).await.unwrap();
    assert_eq!(shoal_net::endpoint::peer_id(&conn), Some(ib));
    let frame = Frame::tokens(9, 1, 0, 5, &[17, 18]);
    let mut tx = conn.open_uni().await.unwrap();
    tx.write_all(&frame.encode()).await.unwrap();
    tx.finish().unwrap();
    assert_eq!(server.await.unwrap(), frame);
}

/// The server must never hand out a connection from `who`.
async fn assert_refused_by_server(server: &Node, client: &Node, server_id: NodeId) {
    let addr = server.local_addr().unwrap();
    let attempt = async {
        if let Ok(conn) = client.connect(addr, server_id, alpn::CONTROL).await {
            // TLS 1.3: the client may finish first; the server's refusal closes it.
            let _ = tokio::time::timeout(Duration::from_secs(5), conn.closed())
                .await
                .expect("refused connection stays open");
        }
    };
    tokio::select! {
        acc = server.accept() => panic!("server accepted an untrusted peer {:?}", acc.map(|a| a.peer)),
        _ = attempt => {}
    }
}

/// Run `n`'s accept loop (as a real node does); returns its address.
fn serve(n: Node) -> std::net::SocketAddr {
    let addr = n.local_addr().unwrap();
    tokio::spawn(async move { while n.accept().await.is_some() {} });
    addr
}

#[tokio::test]
async fn unknown_keys_are_refused_in_the_handshake() {
    let (a, b, c) = ids();
    let (ia, ib, ic) = (a.id(), b.id(), c.id());
    let na = node(&[ib], a);
    let nb = node(&[ia, ic], b);
    let nc = node(&[ia, ib], c);
    // C trusts A, but A does not trust C.
    assert_refused_by_server(&na, &nc, ia).await;
    let (addr_b, addr_c) = (serve(nb), serve(nc));
    // A dials B's address but expects C there: refused on A's side, at once.
    let t = std::time::Instant::now();
    let e = na.connect(addr_b, ic, alpn::PIPELINE).await.expect_err("wrong node accepted");
    assert!(e.to_string().contains("connection with"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "refusal took {:?}", t.elapsed());
    // A dials C, whom it does not trust.
    assert!(na.connect(addr_c, ic, alpn::PIPELINE).await.is_err());
}

#[tokio::test]
async fn revoked_keys_cannot_reconnect() {
    let (na, nb, _conn, _acc) = connected_pair().await;
    let (ia, ib) = (na.id(), nb.id());
    na.trusted().expect("a main endpoint").remove(&ib);
    assert_refused_by_server(&na, &nb, ia).await;
}

/// The handshake checked the key once; removing it must also end the connections it
/// already has, woken by the removal (not at the next poll of the set), whatever their
/// protocol (a control connection here: review F9 found the pipeline's and control's
/// were left open) and with nothing but the node watching.
#[tokio::test]
async fn a_removed_key_loses_its_open_connections_at_once() {
    let (na, nb, conn, acc) = connected_pair().await;
    let ib = nb.id();
    let trusted = na.trusted().expect("a main endpoint").clone();
    // Still trusted: the connection carries data.
    tokio::spawn(async move {
        let (mut tx, mut rx) = acc.conn.accept_bi().await.unwrap();
        let got = rx.read_to_end(64).await.unwrap();
        tx.write_all(&got).await.unwrap();
        tx.finish().unwrap();
        let _ = tx.stopped().await;
    });
    let (mut tx, mut rx) = conn.open_bi().await.unwrap();
    tx.write_all(b"ping").await.unwrap();
    tx.finish().unwrap();
    assert_eq!(rx.read_to_end(64).await.unwrap(), b"ping");
    let t = std::time::Instant::now();
    trusted.remove(&ib);
    assert_closed_as_revoked(&conn).await;
    eprintln!("the removed key's connection closed {:?} after the removal", t.elapsed());
}

/// The same for a connection this node dialled: removing the peer it dialled closes it.
#[tokio::test]
async fn a_removed_key_loses_the_connections_dialled_to_it() {
    let (na, nb, conn, acc) = connected_pair().await;
    // B dialled A; B's owner removes A.
    nb.trusted().expect("a main endpoint").remove(&na.id());
    assert_closed_as_revoked(&acc.conn).await;
    assert!(conn.close_reason().is_some());
}

/// `conn` closes within 10 s, by its peer, for a revoked key.
async fn assert_closed_as_revoked(conn: &quinn::Connection) {
    let why =
        tokio::time::timeout(Duration::from_secs(10), conn.closed()).await.expect("still open 10 s after removal");
    match why {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(c.error_code, shoal_net::endpoint::REVOKED.into());
            assert_eq!(&c.reason[..], b"key revoked");
        }
        other => panic!("closed for another reason: {other}"),
    }
}

#[tokio::test]
async fn unknown_alpn_is_refused() {
    let (a, b, _) = ids();
    let (ia, ib) = (a.id(), b.id());
    let na = node(&[ib], a);
    let nb = node(&[ia], b);
    let addr = na.local_addr().unwrap();
    let attempt = async {
        assert!(nb.connect(addr, ia, b"shoal/nonsense/9").await.is_err());
    };
    tokio::select! {
        acc = na.accept() => panic!("accepted an unknown protocol {:?}", acc.map(|a| a.alpn)),
        _ = attempt => {}
    }
}

/// The impairment layer really delays: a request/response over impaired endpoints
/// takes at least the two one-way delays (a lower bound, so not timing-flaky).
#[tokio::test]
async fn impairment_delays_packets() {
    use shoal_net::Impairment;
    let (a, b, _) = ids();
    let (ia, ib) = (a.id(), b.id());
    let opts = TransportOptions { impair: "delay=30ms".parse::<Impairment>().unwrap(), ..TransportOptions::default() };
    let na = Node::bind("127.0.0.1:0".parse().unwrap(), Arc::new(a), TrustedKeys::new([ib]), &opts).unwrap();
    let nb = Node::bind("127.0.0.1:0".parse().unwrap(), Arc::new(b), TrustedKeys::new([ia]), &opts).unwrap();
    let addr = nb.local_addr().unwrap();
    tokio::spawn(async move {
        let acc = nb.accept().await.unwrap();
        let (mut tx, mut rx) = acc.conn.accept_bi().await.unwrap();
        let got = rx.read_to_end(64).await.unwrap();
        tx.write_all(&got).await.unwrap();
        tx.finish().unwrap();
        let _ = tx.stopped().await;
    });
    let conn = na.connect(addr, ib, alpn::CONTROL).await.unwrap();
    let t0 = std::time::Instant::now();
    let (mut tx, mut rx) = conn.open_bi().await.unwrap();
    tx.write_all(b"ping").await.unwrap();
    tx.finish().unwrap();
    assert_eq!(rx.read_to_end(64).await.unwrap(), b"ping");
    assert!(t0.elapsed() >= Duration::from_millis(60), "round trip took only {:?}", t0.elapsed());
}

/// A rate-limited link really is that slow: 2 MB from an endpoint limited to
/// 40 Mbit/s take at least 0.4 s (a lower bound, so not timing-flaky), and arrive
/// whole although the link's queue drops what would wait too long.
#[tokio::test]
async fn impairment_limits_the_rate() {
    use shoal_net::Impairment;
    let (a, b, _) = ids();
    let (ia, ib) = (a.id(), b.id());
    let slow = TransportOptions { impair: "rate=40mbit".parse::<Impairment>().unwrap(), ..TransportOptions::default() };
    let na = Node::bind("127.0.0.1:0".parse().unwrap(), Arc::new(a), TrustedKeys::new([ib]), &slow).unwrap();
    let nb =
        Node::bind("127.0.0.1:0".parse().unwrap(), Arc::new(b), TrustedKeys::new([ia]), &TransportOptions::default())
            .unwrap();
    let addr = nb.local_addr().unwrap();
    let received = tokio::spawn(async move {
        let acc = nb.accept().await.unwrap();
        let mut rx = acc.conn.accept_uni().await.unwrap();
        rx.read_to_end(4 << 20).await.unwrap()
    });
    let conn = na.connect(addr, ib, alpn::CONTROL).await.unwrap();
    let data: Vec<u8> = (0..2_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let t0 = std::time::Instant::now();
    let mut tx = conn.open_uni().await.unwrap();
    tx.write_all(&data).await.unwrap();
    tx.finish().unwrap();
    let got = received.await.unwrap();
    let took = t0.elapsed();
    assert_eq!(got, data);
    assert!(took >= Duration::from_millis(400), "2 MB at 40 Mbit/s took only {took:?}");
    eprintln!("2 MB at rate=40mbit: {took:?} ({:.1} Mbit/s)", 16.0 / took.as_secs_f64());
}

#[tokio::test]
async fn the_open_join_endpoint_takes_any_key_but_only_the_join_protocol() {
    let (a, b, c) = ids();
    let (ia, ib, ic) = (a.id(), b.id(), c.id());
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let opts = TransportOptions::default();
    let open_a = Node::bind_open(any, Arc::new(a), &opts).unwrap();
    let stranger = Node::bind_open(any, Arc::new(b), &opts).unwrap();
    let addr = open_a.local_addr().unwrap();
    // A stranger's key gets through, speaking JOIN, and both sides know who is who.
    let server = tokio::spawn(async move {
        let acc = open_a.accept().await.expect("a join connection");
        (acc.peer, acc.alpn, open_a)
    });
    let conn = stranger.connect(addr, ia, alpn::JOIN).await.unwrap();
    assert_eq!(shoal_net::endpoint::peer_id(&conn), Some(ia));
    let (peer, proto, open_a) = server.await.unwrap();
    assert_eq!((peer, proto.as_slice()), (ib, alpn::JOIN));
    // No other protocol is spoken there.
    assert!(stranger.connect(addr, ia, alpn::MEMBERSHIP).await.is_err());
    // Dialling from an open endpoint still checks that the node there holds the key named.
    assert!(stranger.connect(addr, ic, alpn::JOIN).await.is_err());
    assert!(open_a.trusted().is_none());
    // And the main endpoint of a node still refuses the stranger.
    let main = node(&[ia], c);
    assert_refused_by_server(&main, &stranger, ic).await;
}
