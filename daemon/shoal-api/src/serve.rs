//! The API's accept loop: the router over hyper's HTTP/1.1 (keep-alive), with the
//! limits a port open to the whole LAN needs, which `axum::serve` does not set: a cap
//! on open connections from other machines in all and per machine (an IPv6 /64 counts
//! as one machine: one host may hold a whole /64), a pool of its own for this machine
//! (loopback), a deadline for a request's headers (which also closes keep-alive
//! connections left idle), and a minimum rate for its body.
//!
//! Why: before any key is checked a stranger can open TCP connections; without these
//! limits a few thousand idle sockets (or headers or a body sent one byte a minute)
//! would use up the node's file descriptors and lock every user out (security review
//! F7: 64 connections from each of 8 addresses, each trickling a login body, filled
//! the 512 places, loopback's too). This machine's own tools have places other
//! machines cannot take.

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
    /// Open connections from this machine (loopback), apart from `max_connections`.
    pub loopback: usize,
    /// A request's body must have arrived at [`MIN_BODY_RATE`] after this grace: the
    /// request fails (and its connection closes) when it falls behind.
    pub body_grace: Duration,
}

/// Bytes a second a request body must keep up after [`Limits::body_grace`]: a slow
/// home link uploads a model far faster; a trickle meant to hold a place does not.
pub const MIN_BODY_RATE: u64 = 16 << 10;

impl Default for Limits {
    /// Far above what a household's tools open (Open WebUI keeps a handful), far below
    /// a process's usual 1024-descriptor limit minus what QUIC and the store hold.
    fn default() -> Limits {
        Limits {
            max_connections: 448,
            per_peer: 64,
            header_timeout: Duration::from_secs(30),
            loopback: 64,
            body_grace: Duration::from_secs(30),
        }
    }
}

/// The connections open now: from other machines in all and per machine, and from
/// this one.
#[derive(Default)]
struct Counts {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
    loopback: usize,
}

/// One admitted connection's place in [`Counts`], given back when it is dropped
/// (when the connection's task ends, however it ends).
struct Slot {
    counts: Arc<Mutex<Counts>>,
    /// The machine counted (see [`machine`]), or `None` for loopback (its own pool).
    peer: Option<IpAddr>,
}

/// The machine `ip` stands for where requests are counted per machine: itself, or
/// for IPv6 its /64 (a host is given a whole /64 and may pick any address in it); an
/// IPv4-mapped address as IPv4.
pub fn machine(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none() => {
            let s = v6.segments();
            IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        IpAddr::V6(v6) => IpAddr::V4(v6.to_ipv4_mapped().unwrap_or(std::net::Ipv4Addr::UNSPECIFIED)),
        v4 => v4,
    }
}

impl Slot {
    /// Admit a connection from `ip` if the limits allow it.
    fn take(counts: &Arc<Mutex<Counts>>, ip: IpAddr, limits: &Limits) -> Option<Slot> {
        let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
        if is_loopback(ip) {
            if c.loopback >= limits.loopback {
                return None;
            }
            c.loopback += 1;
            return Some(Slot { counts: counts.clone(), peer: None });
        }
        if c.total >= limits.max_connections {
            return None;
        }
        let key = machine(ip);
        let n = c.per_peer.entry(key).or_default();
        if *n >= limits.per_peer {
            return None;
        }
        *n += 1;
        c.total += 1;
        Some(Slot { counts: counts.clone(), peer: Some(key) })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let Some(ip) = self.peer else {
            c.loopback = c.loopback.saturating_sub(1);
            return;
        };
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_peer.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                c.per_peer.remove(&ip);
            }
        }
    }
}

/// A request body that fails once it falls behind [`MIN_BODY_RATE`] after `grace`
/// from when the request arrived: a trickle cannot hold a connection's place.
struct PacedBody {
    inner: Incoming,
    /// When the request arrived.
    started: tokio::time::Instant,
    grace: Duration,
    /// Bytes received so far.
    got: u64,
    /// Fires at the deadline for `got` bytes (re-armed as bytes come).
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl PacedBody {
    fn new(inner: Incoming, grace: Duration) -> PacedBody {
        let started = tokio::time::Instant::now();
        PacedBody { inner, started, grace, got: 0, deadline: Box::pin(tokio::time::sleep_until(started + grace)) }
    }

    /// When the body must have more than `got` bytes.
    fn due(&self) -> tokio::time::Instant {
        self.started + self.grace + Duration::from_millis(self.got.saturating_mul(1000) / MIN_BODY_RATE)
    }
}

impl hyper::body::Body for PacedBody {
    type Data = hyper::body::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<hyper::body::Bytes>, Self::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.got += data.len() as u64;
                    let due = this.due();
                    this.deadline.as_mut().reset(due);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    let why = format!("the request body came slower than {} KiB/s", MIN_BODY_RATE >> 10);
                    Poll::Ready(Some(Err(why.into())))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
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
        let grace = limits.body_grace;
        let service = router.clone().map_request(move |mut req: axum::http::Request<Incoming>| {
            req.extensions_mut().insert(ConnectInfo(peer));
            req.map(|b| axum::body::Body::new(PacedBody::new(b, grace)))
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
        let limits = Limits { max_connections: 3, per_peer: 2, loopback: 2, ..Limits::default() };
        let counts = Arc::new(Mutex::new(Counts::default()));
        let lan: IpAddr = "192.168.1.20".parse().unwrap();
        let other: IpAddr = "192.168.1.21".parse().unwrap();
        let third: IpAddr = "192.168.1.22".parse().unwrap();
        let local: IpAddr = "127.0.0.1".parse().unwrap();
        let a = Slot::take(&counts, lan, &limits).expect("first from the LAN machine");
        let b = Slot::take(&counts, lan, &limits).expect("second from the LAN machine");
        assert!(Slot::take(&counts, lan, &limits).is_none(), "a third from one machine is over per_peer");
        let e = Slot::take(&counts, third, &limits).expect("another machine");
        assert!(Slot::take(&counts, other, &limits).is_none(), "the total is reached");
        // Other machines filled their places: this machine's are its own.
        let c = Slot::take(&counts, local, &limits).expect("loopback has places of its own");
        let f = Slot::take(&counts, local, &limits).expect("loopback has places of its own");
        assert!(Slot::take(&counts, local, &limits).is_none(), "loopback's own cap");
        drop(a);
        let d = Slot::take(&counts, other, &limits).expect("a closed connection frees its place");
        drop((b, c, d, e, f));
        let c = counts.lock().unwrap();
        assert_eq!((c.total, c.per_peer.len(), c.loopback), (0, 0, 0), "everything given back");
    }

    #[test]
    fn an_ipv6_64_counts_as_one_machine() {
        let limits = Limits { per_peer: 2, ..Limits::default() };
        let counts = Arc::new(Mutex::new(Counts::default()));
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let _a = Slot::take(&counts, ip("2001:db8:1:2::1"), &limits).unwrap();
        let _b = Slot::take(&counts, ip("2001:db8:1:2:ffff::9"), &limits).unwrap();
        assert!(Slot::take(&counts, ip("2001:db8:1:2:abcd::1"), &limits).is_none(), "the same /64");
        assert!(Slot::take(&counts, ip("2001:db8:1:3::1"), &limits).is_some(), "another /64");
        assert_eq!(machine(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
    }

    #[test]
    fn mapped_ipv6_loopback_is_loopback() {
        assert!(is_loopback("::ffff:127.0.0.1".parse().unwrap()));
        assert!(is_loopback("::1".parse().unwrap()));
        assert!(!is_loopback("::ffff:10.0.0.1".parse().unwrap()));
    }
}
