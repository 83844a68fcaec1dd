//! One endpoint, several services: the connections a pinned endpoint accepts are handed
//! to the service registered for their ALPN (the iroh router's shape). The node process
//! binds one [`Node`] for everything its members speak (membership, admin, probes,
//! pipeline, control, shards), and each service reads its own [`Incoming`] queue, so no
//! service can take another's connections and a protocol nobody serves is closed.

use crate::endpoint::{Accepted, Node};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Connections waiting for a service, per protocol. A service that falls this far
/// behind gets no more until it catches up; the peer's connection is closed instead of
/// queued without bound.
const QUEUE: usize = 64;

/// Application close code of a connection for a protocol this node does not serve.
pub const NOT_SERVED: u32 = 1;

/// Routes a [`Node`]'s accepted connections by ALPN. Dropping the router (and every
/// clone) stops the routing task; the endpoint itself stays open until closed.
#[derive(Clone)]
pub struct Router {
    /// Protocol → the service's queue. Shared with the routing task.
    routes: Arc<Mutex<HashMap<Vec<u8>, mpsc::Sender<Accepted>>>>,
}

/// The connections of one protocol, in the order their handshakes completed.
pub struct Incoming {
    /// The router's end is the sender; closed when the endpoint closes.
    rx: mpsc::Receiver<Accepted>,
}

impl Incoming {
    /// The next connection for this protocol; `None` once the endpoint is closed.
    pub async fn accept(&mut self) -> Option<Accepted> {
        self.rx.recv().await
    }
}

impl Router {
    /// Start routing `node`'s connections. Must run inside a Tokio runtime. Connections
    /// that arrive before their protocol is registered are closed ([`NOT_SERVED`]), as
    /// are those of a protocol whose [`Incoming`] was dropped.
    pub fn new(node: Arc<Node>) -> Router {
        let router = Router { routes: Arc::new(Mutex::new(HashMap::new())) };
        let routes = Arc::downgrade(&router.routes);
        tokio::spawn(async move {
            while let Some(acc) = node.accept().await {
                let Some(routes) = routes.upgrade() else { return };
                let tx = lock(&routes).get(&acc.alpn).cloned();
                let refused = match tx {
                    Some(tx) => match tx.try_send(acc) {
                        Ok(()) => None,
                        Err(mpsc::error::TrySendError::Full(acc)) => Some((acc, "service busy")),
                        Err(mpsc::error::TrySendError::Closed(acc)) => {
                            lock(&routes).remove(&acc.alpn);
                            Some((acc, "protocol not served here"))
                        }
                    },
                    None => Some((acc, "protocol not served here")),
                };
                if let Some((acc, why)) = refused {
                    tracing::info!(peer = %acc.peer, alpn = %String::from_utf8_lossy(&acc.alpn), "connection closed: {why}");
                    acc.conn.close(NOT_SERVED.into(), why.as_bytes());
                }
            }
        });
        router
    }

    /// Take the connections of protocol `alpn` from now on (it must be one the
    /// endpoint was bound with). Registering a protocol again replaces the earlier
    /// service: a restarted service takes over its protocol.
    pub fn route(&self, alpn: &[u8]) -> Incoming {
        let (tx, rx) = mpsc::channel(QUEUE);
        lock(&self.routes).insert(alpn.to_vec(), tx);
        Incoming { rx }
    }

    /// Stop serving `alpn`: its later connections are closed.
    pub fn unroute(&self, alpn: &[u8]) {
        lock(&self.routes).remove(alpn);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a holder panicked between map updates, which leave
    // the map consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
