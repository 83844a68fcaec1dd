//! What a stranger gets from the open join endpoint is bounded: a few connections per
//! source, a few streams per connection, small receive windows that still carry a
//! 1 MiB welcome.

use shoal_net::endpoint::{MAX_HANDSHAKES_PER_SOURCE, OPEN_MAX_STREAMS};
use shoal_net::{alpn, Identity, Node, NodeId};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Duration;

fn open() -> (Node, NodeId) {
    let id = Identity::generate().unwrap();
    let me = id.id();
    (Node::bind_open("127.0.0.1:0".parse().unwrap(), Arc::new(id), &Default::default()).unwrap(), me)
}

/// Serve `n` as a join endpoint: every connection is held, and each bidirectional
/// stream is echoed back (up to 2 MiB).
fn serve_echo(n: Node) -> SocketAddr {
    let addr = n.local_addr().unwrap();
    tokio::spawn(async move {
        while let Some(acc) = n.accept().await {
            tokio::spawn(async move {
                while let Ok((mut tx, mut rx)) = acc.conn.accept_bi().await {
                    tokio::spawn(async move {
                        if let Ok(got) = rx.read_to_end(2 << 20).await {
                            let _ = tx.write_all(&got).await;
                            let _ = tx.finish();
                            let _ = tx.stopped().await;
                        }
                    });
                }
            });
        }
    });
    addr
}

async fn echo(conn: &quinn::Connection, msg: &[u8]) -> Vec<u8> {
    let (mut tx, mut rx) = conn.open_bi().await.unwrap();
    tx.write_all(msg).await.unwrap();
    tx.finish().unwrap();
    rx.read_to_end(2 << 20).await.unwrap()
}

#[tokio::test]
async fn one_source_cannot_hold_more_than_its_share_of_join_connections() {
    let (server, server_id) = open();
    let addr = serve_echo(server);
    let (stranger, _) = open();
    let mut held = Vec::new();
    for _ in 0..MAX_HANDSHAKES_PER_SOURCE {
        held.push(stranger.connect(addr, server_id, alpn::JOIN).await.expect("within the share"));
    }
    let extra = stranger.connect(addr, server_id, alpn::JOIN).await;
    assert!(extra.is_err(), "a connection beyond the per-source share was accepted");
    // The ones within the share still work.
    for conn in &held {
        assert_eq!(echo(conn, b"hello").await, b"hello");
    }
    // A closed one gives its share back (once the endpoint has seen the close).
    held.pop().unwrap().close(0u32.into(), b"done");
    let again = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Ok(c) = stranger.connect(addr, server_id, alpn::JOIN).await {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the share of a closed connection never came back");
    assert_eq!(echo(&again, b"again").await, b"again");
}

/// Poll `f` once: is it ready right now?
fn ready_now<F: Future>(f: F) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    std::pin::pin!(f).poll(&mut cx).is_ready()
}

#[tokio::test]
async fn the_join_endpoint_grants_few_streams() {
    let (server, server_id) = open();
    let addr = serve_echo(server);
    let (stranger, _) = open();
    let conn = stranger.connect(addr, server_id, alpn::JOIN).await.unwrap();
    // The credit comes with the handshake: opening within it is immediate, beyond it
    // waits for the endpoint to grant more, which it does only as streams finish.
    let mut streams = Vec::new();
    for _ in 0..OPEN_MAX_STREAMS {
        let (mut tx, rx) = conn.open_bi().await.unwrap();
        tx.write_all(b"x").await.unwrap();
        streams.push((tx, rx));
    }
    assert!(!ready_now(conn.open_bi()), "a stream beyond the limit was granted");
    assert!(!ready_now(conn.open_uni()), "a unidirectional stream was granted");
    // Finishing one frees a slot.
    let (mut tx, mut rx) = streams.pop().unwrap();
    tx.finish().unwrap();
    assert_eq!(rx.read_to_end(64).await.unwrap(), b"x");
    let (mut tx, mut rx) = tokio::time::timeout(Duration::from_secs(10), conn.open_bi()).await.unwrap().unwrap();
    tx.write_all(b"y").await.unwrap();
    tx.finish().unwrap();
    assert_eq!(rx.read_to_end(64).await.unwrap(), b"y");
}

/// A welcome carries a cluster state of up to 1 MiB; the small join windows pace it
/// but let it through, both ways.
#[tokio::test]
async fn a_one_mib_welcome_still_crosses_the_small_join_windows() {
    let (server, server_id) = open();
    let addr = serve_echo(server);
    let (stranger, _) = open();
    let conn = stranger.connect(addr, server_id, alpn::JOIN).await.unwrap();
    let welcome: Vec<u8> = (0..(1usize << 20)).map(|i| (i % 251) as u8).collect();
    let back = tokio::time::timeout(Duration::from_secs(30), echo(&conn, &welcome)).await.expect("stalled");
    assert!(back == welcome, "the 1 MiB message came back altered ({} bytes)", back.len());
}

/// A join connection has a life (review F7): one a stranger keeps alive with its
/// keep-alives is closed once it is over, and its place comes back, so a stranger's
/// connections cannot hold the endpoint's places for good.
#[tokio::test]
async fn a_join_connection_is_closed_when_its_life_is_over_and_its_place_comes_back() {
    let id = Identity::generate().unwrap();
    let server_id = id.id();
    let opts = shoal_net::TransportOptions { open_connection_life: Duration::from_secs(2), ..Default::default() };
    let server = Node::bind_open("127.0.0.1:0".parse().unwrap(), Arc::new(id), &opts).unwrap();
    let addr = serve_echo(server);
    let (stranger, _) = open();
    let mut held = Vec::new();
    for _ in 0..MAX_HANDSHAKES_PER_SOURCE {
        held.push(stranger.connect(addr, server_id, alpn::JOIN).await.expect("within the share"));
    }
    assert!(stranger.connect(addr, server_id, alpn::JOIN).await.is_err(), "the share is full");
    // Kept alive (1 s keep-alives) past the life: closed by the endpoint.
    for conn in &held {
        let why =
            tokio::time::timeout(Duration::from_secs(10), conn.closed()).await.expect("still open after its life");
        assert!(matches!(why, quinn::ConnectionError::ApplicationClosed(_)), "{why}");
    }
    // The places are free again.
    let again = stranger.connect(addr, server_id, alpn::JOIN).await.expect("a place came back");
    assert_eq!(echo(&again, b"hi").await, b"hi");
}
