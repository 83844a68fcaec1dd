//! The API's accept loop: the router over hyper's HTTP/1.1 (keep-alive), with the
//! limits a port open to the whole LAN needs, which `axum::serve` does not set: a cap
//! on open connections in all and per other machine, and a deadline for a request's
//! headers (which also closes keep-alive connections left idle).
//!
//! Why: before any key is checked a stranger can open TCP connections; without these
//! limits a few thousand idle sockets (or headers sent one byte a minute) would use up
//! the node's file descriptors and lock every user out. Requests from this machine
//! (loopback) count only towards the total, so local tools are never refused because
//! of their own number of connections.

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower::ServiceExt;

/// How many connections the API holds open, and how long it waits for headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Open connections in all; one more is closed at once.
    pub max_connections: usize,
    /// Open connections from one other machine (loopback is not counted here).
    pub per_peer: usize,
    /// Time for a request's headers to arrive, counted from when the server starts
    /// waiting for them: a connection that sends nothing (a new one, or a keep-alive
    /// one between requests) is closed after it.
    pub header_timeout: Duration,
}

impl Default for Limits {
    /// Far above what a household's tools open (Open WebUI keeps a handful), far below
    /// a process's usual 1024-descriptor limit minus what QUIC and the store hold.
    fn default() -> Limits {
        Limits { max_connections: 512, per_peer: 64, header_timeout: Duration::from_secs(30) }
    }
}

/// The connections open now: in all and per other machine.
#[derive(Default)]
struct Counts {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// One admitted connection's place in [`Counts`], given back when it is dropped
/// (when the connection's task ends, however it ends).
struct Slot {
    counts: Arc<Mutex<Counts>>,
    /// The machine counted, or `None` for loopback (counted only in the total).
    peer: Option<IpAddr>,
}

impl Slot {
    /// Admit a connection from `ip` if the limits allow it.
    fn take(counts: &Arc<Mutex<Counts>>, ip: IpAddr, limits: &Limits) -> Option<Slot> {
        let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
        if c.total >= limits.max_connections {
            return None;
        }
        let peer = (!is_loopback(ip)).then_some(ip);
        if let Some(ip) = peer {
            let n = c.per_peer.entry(ip).or_default();
            if *n >= limits.per_peer {
                return None;
            }
            *n += 1;
        }
        c.total += 1;
        Some(Slot { counts: counts.clone(), peer })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.total = c.total.saturating_sub(1);
        if let Some(ip) = self.peer {
            if let Some(n) = c.per_peer.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    c.per_peer.remove(&ip);
                }
            }
        }
    }
}

/// Whether `ip` is this machine (IPv4-mapped IPv6 loopback included).
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
    }
}

/// Serve `router` on `listener` within `limits` until `shutdown` completes; then stop
/// accepting, let every open connection finish its request, and return.
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let counts = Arc::new(Mutex::new(Counts::default()));
    // `stop_tx` tells connections to finish; `done_tx.closed()` waits for all of them
    // (each holds a `done_rx` clone until its task ends).
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(());
    let (done_tx, done_rx) = tokio::sync::watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: wait a
                    // moment rather than spin, and go on.
                    tracing::debug!(error = %e, "API accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(slot) = Slot::take(&counts, peer.ip(), &limits) else {
            tracing::debug!(%peer, "API connection refused: connection limit");
            continue; // dropping the stream closes it
        };
        // Tokens are small writes: without this each SSE event may wait for an ACK.
        let _ = stream.set_nodelay(true);
        let service = router.clone().map_request(move |mut req: axum::http::Request<Incoming>| {
            req.extensions_mut().insert(ConnectInfo(peer));
            req.map(axum::body::Body::new)
        });
        let mut stop = stop_rx.clone();
        let done = done_rx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _done = done;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(e) = result {
                        tracing::trace!(error = %e, %peer, "API connection ended");
                    }
                    return;
                }
                _ = stop.changed() => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    drop(done_rx);
    let _ = stop_tx.send(());
    done_tx.closed().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_count_per_machine_and_in_all_and_come_back_when_dropped() {
        let limits = Limits { max_connections: 3, per_peer: 2, header_timeout: Duration::from_secs(1) };
        let counts = Arc::new(Mutex::new(Counts::default()));
        let lan: IpAddr = "192.168.1.20".parse().unwrap();
        let other: IpAddr = "192.168.1.21".parse().unwrap();
        let local: IpAddr = "127.0.0.1".parse().unwrap();
        let a = Slot::take(&counts, lan, &limits).expect("first from the LAN machine");
        let b = Slot::take(&counts, lan, &limits).expect("second from the LAN machine");
        assert!(Slot::take(&counts, lan, &limits).is_none(), "a third from one machine is over per_peer");
        let c = Slot::take(&counts, local, &limits).expect("loopback is not held to per_peer");
        assert!(Slot::take(&counts, other, &limits).is_none(), "the total is reached");
        drop(a);
        let d = Slot::take(&counts, other, &limits).expect("a closed connection frees its place");
        drop((b, c, d));
        let c = counts.lock().unwrap();
        assert_eq!((c.total, c.per_peer.len()), (0, 0), "everything given back");
    }

    #[test]
    fn mapped_ipv6_loopback_is_loopback() {
        assert!(is_loopback("::ffff:127.0.0.1".parse().unwrap()));
        assert!(is_loopback("::1".parse().unwrap()));
        assert!(!is_loopback("::ffff:10.0.0.1".parse().unwrap()));
    }
}
