//! One QUIC endpoint per node (quinn), serving several protocols told apart by ALPN,
//! with pinned-key mutual TLS on every connection. Keep-alive and idle timeouts are
//! sized for home WiFi: a link silent for a few seconds survives without a reconnect.
//!
//! Admission is bounded so that a stranger cannot deny members a handshake. An
//! incoming connection whose source address is not proven (a QUIC Initial can carry
//! any source) gets a stateless Retry once handshakes in progress pass
//! [`RETRY_ABOVE`], and always on the open join endpoint; only a proven source is
//! counted against a per-source cap ([`MAX_HANDSHAKES_PER_SOURCE`]), so spoofing a
//! member's address cannot use up that member's share. The join endpoint also caps
//! connections per source and in total, and grants few streams and small windows.

use crate::identity::{Identity, NodeId};
use crate::impair::{ImpairedSocket, Impairment};
use crate::tls::{client_config, node_id_of, server_config, TrustedKeys};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::CertificateDer;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The protocols a node speaks, one ALPN each.
pub mod alpn {
    /// Pipeline frames between stages.
    pub const PIPELINE: &[u8] = b"shoal/pipeline/1";
    /// Control: status, placement.
    pub const CONTROL: &[u8] = b"shoal/control/1";
    /// Membership between approved members: beats, election, cluster state.
    pub const MEMBERSHIP: &[u8] = b"shoal/membership/1";
    /// Administration of this node by its owner (the CLI, holding the node's own key).
    pub const ADMIN: &[u8] = b"shoal/admin/1";
    /// Link probes between members (frame latency and bandwidth for the planner).
    pub const PROBE: &[u8] = b"shoal/probe/1";
    /// The node process's own requests (models, placements) from its owner's CLI and,
    /// for reading, from members.
    pub const NODE: &[u8] = b"shoal/node/1";
    /// Shard transfer between members (`shoal-transfer`): a stage node fetches the
    /// shard of its layers from a member that holds it or its source model.
    pub const SHARD: &[u8] = b"shoal/shard/1";
    /// Everything a node's main endpoint accepts (approved keys only).
    pub const ALL: &[&[u8]] = &[PIPELINE, CONTROL, MEMBERSHIP, ADMIN, PROBE, NODE, SHARD];
    /// Joining: the only protocol of the open join endpoint, which accepts any key.
    pub const JOIN: &[u8] = b"shoal/join/1";
}

/// Errors of the endpoint.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// Binding the UDP socket failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    /// TLS configuration failed.
    #[error("TLS setup: {0}")]
    Tls(#[from] rustls::Error),
    /// Could not start a connection.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: quinn::ConnectError,
    },
    /// The handshake or the connection failed (a refused key ends up here).
    #[error("connection with {addr} failed: {source}")]
    Connection { addr: SocketAddr, source: quinn::ConnectionError },
    /// The peer did not present a usable certificate.
    #[error("peer at {0} presented no node key")]
    NoPeerKey(SocketAddr),
}

/// Transport timing.
#[derive(Clone, Debug)]
pub struct TransportOptions {
    /// A keep-alive is sent after this much silence.
    pub keep_alive: Duration,
    /// A connection silent this long is dead.
    pub idle_timeout: Duration,
    /// Test/bench only: delay, jitter and loss applied to outgoing datagrams.
    pub impair: Impairment,
    /// The open join endpoint closes a connection this long after its handshake, busy
    /// or not ([`OPEN_CONNECTION_LIFE`]; tests shorten it).
    pub open_connection_life: Duration,
}

impl Default for TransportOptions {
    fn default() -> Self {
        Self {
            keep_alive: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(10),
            impair: Impairment::default(),
            open_connection_life: OPEN_CONNECTION_LIFE,
        }
    }
}

/// How long a join connection may live: a join request, a hello or a pairing exchange
/// (which gives up after 35 s) takes far less. Without it, a stranger's keep-alives
/// held the join endpoint's 64 places for good: no pairing, no welcome, no removal
/// check for anyone (security review F7).
pub const OPEN_CONNECTION_LIFE: Duration = Duration::from_secs(60);

/// An accepted connection.
pub struct Accepted {
    /// The connection.
    pub conn: quinn::Connection,
    /// Who is on the other side (verified in the handshake).
    pub peer: NodeId,
    /// The protocol it speaks.
    pub alpn: Vec<u8>,
}

/// A node's QUIC endpoint.
pub struct Node {
    endpoint: quinn::Endpoint,
    identity: Arc<Identity>,
    /// Keys accepted, both ways; `None` for an open join endpoint.
    trusted: Option<TrustedKeys>,
    transport: Arc<quinn::TransportConfig>,
    /// Connections whose handshake succeeded. Handshakes run concurrently (a peer that
    /// starts one and goes silent must not hold up the others), at most
    /// [`MAX_HANDSHAKES`] at once.
    accepted: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Accepted>>,
}

/// Handshakes in progress at once; more incoming connections are refused meanwhile.
pub const MAX_HANDSHAKES: usize = 64;

/// With this many handshakes in progress, a source that has not proven its address
/// gets a QUIC Retry instead of a handshake slot (a spoofed source never answers it,
/// a real one comes back proven). So unproven handshakes hold at most this many
/// slots and the rest stay free for proven ones.
pub const RETRY_ABOVE: usize = MAX_HANDSHAKES / 2;

/// Handshakes in progress at once from one proven source (an IPv4 address, or an
/// IPv6 /64); on the open join endpoint this counts its open connections too.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 8;

/// Handshakes and connections at once on the open join endpoint, all sources together.
pub const OPEN_MAX_CONNECTIONS: usize = 64;

/// Streams a peer may have open at once on a join connection (bidirectional; no
/// unidirectional ones: the join protocol does not use them).
pub const OPEN_MAX_STREAMS: u32 = 4;

/// Receive window of one stream on a join connection. A welcome carrying a cluster
/// state of up to 1 MiB still gets through: flow control only paces it.
pub const OPEN_STREAM_WINDOW: u32 = 64 * 1024;

/// Receive window of a whole join connection (all its streams).
pub const OPEN_CONNECTION_WINDOW: u32 = 256 * 1024;

/// The application close code of a connection whose peer's key was removed.
pub const REVOKED: u32 = 2;

impl Node {
    /// Listen on `addr` (port 0: any free port). Must run inside a Tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        identity: Arc<Identity>,
        trusted: TrustedKeys,
        opts: &TransportOptions,
    ) -> Result<Node, NetError> {
        Node::bind_with(addr, identity, Some(trusted), alpn::ALL, opts)
    }

    /// The open join endpoint: accepts a handshake from any key (the peer still proves
    /// it holds the key it presents) but speaks only [`alpn::JOIN`], where nothing is
    /// served to a stranger beyond public facts and a pairing exchange. Dialling from
    /// it reaches any node whose key the caller names.
    pub fn bind_open(addr: SocketAddr, identity: Arc<Identity>, opts: &TransportOptions) -> Result<Node, NetError> {
        Node::bind_with(addr, identity, None, &[alpn::JOIN], opts)
    }

    fn bind_with(
        addr: SocketAddr,
        identity: Arc<Identity>,
        trusted: Option<TrustedKeys>,
        alpns: &[&[u8]],
        opts: &TransportOptions,
    ) -> Result<Node, NetError> {
        let open = trusted.is_none();
        let mut transport = quinn::TransportConfig::default();
        transport.keep_alive_interval(Some(opts.keep_alive));
        // Home networks answer in milliseconds: QUIC's default guess before the first
        // sample (333 ms) makes a handshake that lost its first packets (a link that
        // just came back) retry after ~1 s, then 3 s, then 7 s; this retries after
        // ~0.3, 1 and 2.3 s. Once a round trip is measured, the measurement rules.
        transport.initial_rtt(Duration::from_millis(100));
        // Invariant: the idle timeouts we use are far below QUIC's 2^62 ms bound.
        transport.max_idle_timeout(Some(opts.idle_timeout.try_into().expect("idle timeout fits in a VarInt")));
        if open {
            // A stranger gets little: a few request streams, small buffers, no datagrams.
            transport.max_concurrent_bidi_streams(OPEN_MAX_STREAMS.into());
            transport.max_concurrent_uni_streams(0u32.into());
            transport.stream_receive_window(OPEN_STREAM_WINDOW.into());
            transport.receive_window(OPEN_CONNECTION_WINDOW.into());
            transport.datagram_receive_buffer_size(None);
        }
        let transport = Arc::new(transport);
        let tls = server_config(&identity, trusted.as_ref(), alpns)?;
        let quic = QuicServerConfig::try_from(tls).map_err(|e| rustls::Error::General(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(quic));
        server.transport_config(transport.clone());
        let bind = |source| NetError::Bind { addr, source };
        // Stateless resets and connection ids keyed by the node's identity (see
        // `Identity::reset_key`): a restarted node resets its old connections at once.
        let reset = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &identity.reset_key());
        let mut config = quinn::EndpointConfig::new(Arc::new(reset));
        let cid_key = identity.connection_id_key();
        config.cid_generator(move || Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key)));
        let runtime: Arc<dyn quinn::Runtime> = Arc::new(quinn::TokioRuntime);
        let endpoint = if opts.impair.is_none() {
            let socket = std::net::UdpSocket::bind(addr).map_err(bind)?;
            quinn::Endpoint::new(config, Some(server), socket, runtime).map_err(bind)?
        } else {
            let socket = runtime.wrap_udp_socket(std::net::UdpSocket::bind(addr).map_err(bind)?).map_err(bind)?;
            let socket = Arc::new(ImpairedSocket::new(socket, opts.impair));
            quinn::Endpoint::new_with_abstract_socket(config, Some(server), socket, runtime).map_err(bind)?
        };
        let (tx, rx) = tokio::sync::mpsc::channel(MAX_HANDSHAKES);
        // A main endpoint watches every connection it accepts: a member removed later
        // loses them at once, whatever protocol they carry.
        let watch = trusted.clone().map(|t| (t, identity.id()));
        tokio::spawn(handshakes(endpoint.clone(), tx, (open, opts.open_connection_life), watch));
        Ok(Node { endpoint, identity, trusted, transport, accepted: tokio::sync::Mutex::new(rx) })
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.identity.id()
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// The keys it accepts (`None`: an open join endpoint).
    pub fn trusted(&self) -> Option<&TrustedKeys> {
        self.trusted.as_ref()
    }

    /// Connect to node `peer` at `addr` for protocol `alpn`. Fails in the handshake if
    /// the node there does not hold `peer`'s key, or `peer` is not trusted.
    pub async fn connect(&self, addr: SocketAddr, peer: NodeId, alpn: &[u8]) -> Result<quinn::Connection, NetError> {
        let tls = client_config(&self.identity, self.trusted.as_ref(), peer, alpn)?;
        let quic = QuicClientConfig::try_from(tls).map_err(|e| rustls::Error::General(e.to_string()))?;
        let mut config = quinn::ClientConfig::new(Arc::new(quic));
        config.transport_config(self.transport.clone());
        let connecting =
            self.endpoint.connect_with(config, addr, "shoal").map_err(|source| NetError::Connect { addr, source })?;
        let conn = connecting.await.map_err(|source| NetError::Connection { addr, source })?;
        // As for accepted connections: one to a member removed later closes at once.
        if let Some(trusted) = self.trusted.as_ref().filter(|_| peer != self.id()) {
            tokio::spawn(close_when_revoked(conn.clone(), peer, trusted.clone()));
        }
        Ok(conn)
    }

    /// The next incoming connection whose handshake succeeded; `None` once closed.
    /// Failed handshakes (unknown keys, scanners) are logged and skipped.
    pub async fn accept(&self) -> Option<Accepted> {
        self.accepted.lock().await.recv().await
    }

    /// Close every connection and stop accepting.
    pub fn close(&self) {
        self.endpoint.close(0u32.into(), b"shutting down");
    }

    /// Wait until closed connections have told their peers (after [`Node::close`]), so
    /// the peers learn of it now rather than at their idle timeout.
    pub async fn wait_idle(&self) {
        self.endpoint.wait_idle().await;
    }
}

/// How many handshakes (and, on the join endpoint, connections) each proven source
/// holds. An IPv6 source counts by its /64, which one host can fill with addresses.
#[derive(Default)]
struct PerSource(Mutex<HashMap<IpAddr, usize>>);

/// One unit of a source's share, given back when dropped.
struct SourceSlot {
    sources: Arc<PerSource>,
    key: IpAddr,
}

impl PerSource {
    fn key(ip: IpAddr) -> IpAddr {
        match ip.to_canonical() {
            IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !(u64::MAX as u128)).into()),
            v4 => v4,
        }
    }

    /// A slot for `ip` if it holds fewer than `cap`.
    fn take(self: &Arc<Self>, ip: IpAddr, cap: usize) -> Option<SourceSlot> {
        let key = Self::key(ip);
        // A poisoned lock only means a holder panicked between two integer updates.
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = held.entry(key).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(SourceSlot { sources: self.clone(), key })
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut held = self.sources.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

/// Accept incoming connections, each handshake in a task of its own, and pass on the
/// ones that succeed. `open`: the join endpoint (see the module docs for the limits),
/// whose connections close `life` after their handshake.
/// `watch`: a main endpoint's trusted keys and own id, to close a removed member's
/// connections ([`close_when_revoked`]).
async fn handshakes(
    endpoint: quinn::Endpoint,
    tx: tokio::sync::mpsc::Sender<Accepted>,
    (open, life): (bool, Duration),
    watch: Option<(TrustedKeys, NodeId)>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    let connections = Arc::new(tokio::sync::Semaphore::new(OPEN_MAX_CONNECTIONS));
    let sources = Arc::new(PerSource::default());
    while let Some(incoming) = endpoint.accept().await {
        let addr = incoming.remote_address();
        let proven = incoming.remote_address_validated();
        let in_progress = MAX_HANDSHAKES - slots.available_permits();
        if !proven && (open || in_progress >= RETRY_ABOVE) {
            // Stateless: nothing is kept until the source answers from its address.
            // retry() fails only where the Initial already answered a Retry, which an
            // unproven one cannot have; drop it quietly then.
            if let Err(e) = incoming.retry() {
                e.into_incoming().ignore();
            }
            continue;
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%addr, "too many handshakes in progress; connection refused");
            incoming.refuse();
            continue;
        };
        // Unproven sources (below RETRY_ABOVE) are not counted per source: their
        // address may be a member's, spoofed.
        let source = if proven {
            let Some(s) = sources.take(addr.ip(), MAX_HANDSHAKES_PER_SOURCE) else {
                tracing::warn!(%addr, "too many handshakes from one source; connection refused");
                incoming.refuse();
                continue;
            };
            Some(s)
        } else {
            None
        };
        let connection = if open {
            let Ok(c) = connections.clone().try_acquire_owned() else {
                tracing::warn!(%addr, "the join endpoint is full; connection refused");
                incoming.refuse();
                continue;
            };
            Some(c)
        } else {
            None
        };
        let (tx, watch) = (tx.clone(), watch.clone());
        tokio::spawn(async move {
            let hs = incoming.await;
            drop(slot);
            let conn = match hs {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::info!(%addr, "incoming handshake failed: {e}");
                    return;
                }
            };
            let alpn = conn
                .handshake_data()
                .and_then(|h| h.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                .and_then(|h| h.protocol);
            let (Some(peer), Some(alpn)) = (peer_id(&conn), alpn) else {
                tracing::warn!(%addr, "connection without a node key or protocol; closed");
                return;
            };
            if open {
                // The join endpoint's shares are held for the connection's life, which
                // has an end.
                let _ = tx.send(Accepted { conn: conn.clone(), peer, alpn }).await;
                tokio::select! {
                    _ = conn.closed() => {}
                    () = tokio::time::sleep(life) => {
                        conn.close(0u32.into(), b"join connection lived its time");
                    }
                }
                drop((source, connection));
            } else {
                drop(source);
                // The node's own key (its owner's CLI) is not a member's to lose.
                if let Some((trusted, _)) = watch.filter(|(_, me)| *me != peer) {
                    tokio::spawn(close_when_revoked(conn.clone(), peer, trusted));
                }
                let _ = tx.send(Accepted { conn, peer, alpn }).await;
            }
        });
    }
}

/// Close `conn` (application code [`REVOKED`]) the moment `peer`'s key is removed from
/// `trusted`; returns when either happens. A main endpoint's [`Node`] runs it for every
/// connection it accepts or dials (but its own key's), whatever the protocol. The handshake checked the key once, and
/// keep-alives would hold the connection open for good. Spawn one per connection of
/// a pinned endpoint, accepted or dialled.
pub async fn close_when_revoked(conn: quinn::Connection, peer: NodeId, trusted: TrustedKeys) {
    tokio::select! {
        _ = conn.closed() => {}
        _ = trusted.revoked(&peer) => {
            tracing::info!(%peer, "closing a connection of a removed key");
            conn.close(REVOKED.into(), b"key revoked");
        }
    }
}

/// The verified node id of the peer of `conn`.
pub fn peer_id(conn: &quinn::Connection) -> Option<NodeId> {
    let certs = conn.peer_identity()?.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    node_id_of(certs.first()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An attacker's client: the node's own client TLS config with resumption (and
    /// 0-RTT) turned back on, one config (so one session store) shared by every connection it makes.
    fn resuming_client(me: &Identity, server: NodeId) -> quinn::ClientConfig {
        // Invariant: our own identity and provider always make a valid config.
        let mut tls = client_config(me, None, server, alpn::CONTROL).expect("client config");
        tls.resumption = rustls::client::Resumption::in_memory_sessions(16);
        tls.enable_early_data = true;
        let quic = QuicClientConfig::try_from(tls).expect("a TLS 1.3 config");
        quinn::ClientConfig::new(Arc::new(quic))
    }

    #[tokio::test]
    async fn a_saved_tls_session_does_not_let_a_revoked_key_back_in() {
        let (a, b) = (Identity::generate().unwrap(), Identity::generate().unwrap());
        let (ia, ib) = (a.id(), b.id());
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let server = Node::bind(any, Arc::new(a), TrustedKeys::new([ib]), &TransportOptions::default()).unwrap();
        let addr = server.local_addr().unwrap();
        let config = resuming_client(&b, ia);
        let client = quinn::Endpoint::client(any).unwrap();

        // While trusted: connect, and do one round trip so that whatever session
        // ticket the server sends has reached the client before it goes.
        let first = client.connect_with(config.clone(), addr, "shoal").unwrap().await.unwrap();
        let acc = server.accept().await.expect("the trusted key is accepted");
        assert_eq!(acc.peer, ib);
        let echo = tokio::spawn(async move {
            let (mut tx, mut rx) = acc.conn.accept_bi().await.unwrap();
            let got = rx.read_to_end(64).await.unwrap();
            tx.write_all(&got).await.unwrap();
            tx.finish().unwrap();
            let _ = tx.stopped().await;
        });
        let (mut tx, mut rx) = first.open_bi().await.unwrap();
        tx.write_all(b"ping").await.unwrap();
        tx.finish().unwrap();
        assert_eq!(rx.read_to_end(64).await.unwrap(), b"ping");
        echo.await.unwrap();
        first.close(0u32.into(), b"bye");

        // The owner removes the key; the attacker comes back with its saved session.
        server.trusted().expect("a main endpoint").remove(&ib);
        let attempt = async {
            let connecting = client.connect_with(config.clone(), addr, "shoal").unwrap();
            // Nor can it send 0-RTT data on its saved session.
            let connecting = match connecting.into_0rtt() {
                Ok(_) => panic!("0-RTT was possible for a revoked key"),
                Err(connecting) => connecting,
            };
            if let Ok(conn) = connecting.await {
                // TLS 1.3: the client may finish first; the server's refusal closes it.
                let _ = tokio::time::timeout(Duration::from_secs(5), conn.closed())
                    .await
                    .expect("the connection of a revoked key stays open");
            }
        };
        tokio::select! {
            acc = server.accept() => {
                panic!("a revoked key got back in on a resumed TLS session: {:?}", acc.map(|a| a.peer))
            }
            _ = attempt => {}
        }
    }
}
