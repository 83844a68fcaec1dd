//! Link probes over real QUIC on 127.0.0.1: the measured frame time carries a delay
//! the impairment layer adds on the way out, the bandwidth is a positive figure, and a
//! peer asking for more than the limit gets its stream refused, nothing else.

use shoal_net::probe::{self, ProbeOptions, MAX_PROBE_BYTES};
use shoal_net::{alpn, Identity, Node, TransportOptions, TrustedKeys};
use std::sync::Arc;
use std::time::Duration;

/// Two trusted endpoints; `b` serves probes; `a`'s outgoing datagrams get `impair`.
async fn pair(impair: &str) -> (Node, quinn::Connection) {
    let (a, b) = (Identity::generate().unwrap(), Identity::generate().unwrap());
    let (ia, ib) = (a.id(), b.id());
    let opts = TransportOptions { impair: impair.parse().unwrap(), ..TransportOptions::default() };
    let na = Node::bind("127.0.0.1:0".parse().unwrap(), Arc::new(a), TrustedKeys::new([ib]), &opts).unwrap();
    let nb =
        Node::bind("127.0.0.1:0".parse().unwrap(), Arc::new(b), TrustedKeys::new([ia]), &TransportOptions::default())
            .unwrap();
    let addr = nb.local_addr().unwrap();
    tokio::spawn(async move {
        while let Some(acc) = nb.accept().await {
            assert_eq!(acc.alpn, alpn::PROBE);
            tokio::spawn(probe::serve(acc.conn));
        }
    });
    let conn = na.connect(addr, ib, alpn::PROBE).await.unwrap();
    (na, conn)
}

#[tokio::test]
async fn a_probe_measures_the_delay_of_the_link() {
    let opts = ProbeOptions { rounds: 7, bulk_bytes: 1 << 20, ..ProbeOptions::default() };
    let (_a, conn) = pair("").await;
    let bare = probe::measure(&conn, &opts).await.unwrap();
    assert_eq!((bare.samples, bare.frame_bytes), (7, 4096));
    assert!(bare.frame_ms > 0.0 && bare.hot_frame_ms > 0.0 && bare.mbit_per_s > 0.0, "{bare:?}");
    // 8 ms on the way out of `a` only: an echo takes at least 8 ms, one way half of it
    // at least, and bare loopback cannot explain that much.
    let (_a, conn) = pair("delay=8ms").await;
    let slow = probe::measure(&conn, &opts).await.unwrap();
    assert!(slow.frame_ms >= 4.0 && slow.hot_frame_ms >= 4.0, "{slow:?}");
    assert!(slow.rtt_ms >= 8.0, "{slow:?}");
    assert!(slow.frame_ms > bare.frame_ms, "{slow:?} vs {bare:?}");
}

#[tokio::test]
async fn oversized_probes_are_refused_and_the_server_keeps_serving() {
    let (_a, conn) = pair("").await;
    let too_big = ProbeOptions { bulk_bytes: MAX_PROBE_BYTES + 1, ..ProbeOptions::default() };
    assert!(probe::measure(&conn, &too_big).await.unwrap_err().to_string().contains("limit"));
    let empty = ProbeOptions { frame_bytes: 0, ..ProbeOptions::default() };
    assert!(probe::measure(&conn, &empty).await.is_err());
    // A hand-made header asking for a reply over the frame limit: the server resets
    // that stream.
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let mut header = 0u32.to_be_bytes().to_vec();
    header.extend((shoal_net::probe::MAX_FRAME_BYTES + 1).to_be_bytes());
    send.write_all(&header).await.unwrap();
    send.finish().unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(1 << 20)).await.unwrap();
    assert!(got.is_err(), "the stream should be reset, got {got:?}");
    // Garbage then the end of the stream: nothing breaks.
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(b"xyz").await.unwrap();
    send.finish().unwrap();
    let fine = ProbeOptions { rounds: 3, bulk_bytes: 0, ..ProbeOptions::default() };
    let m = probe::measure(&conn, &fine).await.unwrap();
    assert_eq!((m.samples, m.mbit_per_s), (3, 0.0));
}
