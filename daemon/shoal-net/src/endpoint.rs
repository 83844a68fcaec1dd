//! One QUIC endpoint per node (quinn), serving several protocols told apart by ALPN,
//! with pinned-key mutual TLS on every connection. Keep-alive and idle timeouts are
//! sized for home WiFi: a link silent for a few seconds survives without a reconnect.

use crate::identity::{Identity, NodeId};
use crate::impair::{ImpairedSocket, Impairment};
use crate::tls::{client_config, node_id_of, server_config, TrustedKeys};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::CertificateDer;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The protocols a node speaks, one ALPN each.
pub mod alpn {
    /// Pipeline frames between stages.
    pub const PIPELINE: &[u8] = b"shoal/pipeline/1";
    /// Control: status, placement, (later) shard transfer.
    pub const CONTROL: &[u8] = b"shoal/control/1";
    /// Membership between approved members: beats, election, cluster state.
    pub const MEMBERSHIP: &[u8] = b"shoal/membership/1";
    /// Administration of this node by its owner (the CLI, holding the node's own key).
    pub const ADMIN: &[u8] = b"shoal/admin/1";
    /// Link probes between members (frame latency and bandwidth for the planner).
    pub const PROBE: &[u8] = b"shoal/probe/1";
    /// Everything a node's main endpoint accepts (approved keys only).
    pub const ALL: &[&[u8]] = &[PIPELINE, CONTROL, MEMBERSHIP, ADMIN, PROBE];
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
}

impl Default for TransportOptions {
    fn default() -> Self {
        Self {
            keep_alive: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(10),
            impair: Impairment::default(),
        }
    }
}

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
        let mut transport = quinn::TransportConfig::default();
        transport.keep_alive_interval(Some(opts.keep_alive));
        // Invariant: the idle timeouts we use are far below QUIC's 2^62 ms bound.
        transport.max_idle_timeout(Some(opts.idle_timeout.try_into().expect("idle timeout fits in a VarInt")));
        let transport = Arc::new(transport);
        let tls = server_config(&identity, trusted.as_ref(), alpns)?;
        let quic = QuicServerConfig::try_from(tls).map_err(|e| rustls::Error::General(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(quic));
        server.transport_config(transport.clone());
        let bind = |source| NetError::Bind { addr, source };
        let endpoint = if opts.impair.is_none() {
            quinn::Endpoint::server(server, addr).map_err(bind)?
        } else {
            let runtime: Arc<dyn quinn::Runtime> = Arc::new(quinn::TokioRuntime);
            let socket = runtime.wrap_udp_socket(std::net::UdpSocket::bind(addr).map_err(bind)?).map_err(bind)?;
            let socket = Arc::new(ImpairedSocket::new(socket, opts.impair));
            quinn::Endpoint::new_with_abstract_socket(quinn::EndpointConfig::default(), Some(server), socket, runtime)
                .map_err(bind)?
        };
        let (tx, rx) = tokio::sync::mpsc::channel(MAX_HANDSHAKES);
        tokio::spawn(handshakes(endpoint.clone(), tx));
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
        connecting.await.map_err(|source| NetError::Connection { addr, source })
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

/// Accept incoming connections, each handshake in a task of its own, and pass on the
/// ones that succeed.
async fn handshakes(endpoint: quinn::Endpoint, tx: tokio::sync::mpsc::Sender<Accepted>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    while let Some(incoming) = endpoint.accept().await {
        let addr = incoming.remote_address();
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%addr, "too many handshakes in progress; connection refused");
            incoming.refuse();
            continue;
        };
        let tx = tx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            match incoming.await {
                Ok(conn) => {
                    let alpn = conn
                        .handshake_data()
                        .and_then(|h| h.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                        .and_then(|h| h.protocol);
                    match (peer_id(&conn), alpn) {
                        (Some(peer), Some(alpn)) => {
                            let _ = tx.send(Accepted { conn, peer, alpn }).await;
                        }
                        _ => tracing::warn!(%addr, "connection without a node key or protocol; closed"),
                    }
                }
                Err(e) => tracing::info!(%addr, "incoming handshake failed: {e}"),
            }
        });
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

    /// An attacker's client: the node's own client TLS config with resumption turned
    /// back on, one config (so one session store) shared by every connection it makes.
    fn resuming_client(me: &Identity, server: NodeId) -> quinn::ClientConfig {
        // Invariant: our own identity and provider always make a valid config.
        let mut tls = client_config(me, None, server, alpn::CONTROL).expect("client config");
        tls.resumption = rustls::client::Resumption::in_memory_sessions(16);
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
            if let Ok(conn) = client.connect_with(config.clone(), addr, "shoal").unwrap().await {
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
