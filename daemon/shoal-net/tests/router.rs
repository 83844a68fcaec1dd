//! One endpoint, several services: each protocol's connections reach only the service
//! registered for it, and a protocol nobody serves is closed, not left hanging.

use shoal_net::router::{Router, NOT_SERVED};
use shoal_net::{alpn, Identity, Node, TransportOptions, TrustedKeys};
use std::sync::Arc;
use std::time::Duration;

fn pair() -> (Arc<Node>, Node) {
    let (a, b) = (Identity::generate().unwrap(), Identity::generate().unwrap());
    let (ia, ib) = (a.id(), b.id());
    let opts = TransportOptions::default();
    let any = "127.0.0.1:0".parse().unwrap();
    let server = Node::bind(any, Arc::new(a), TrustedKeys::new([ib]), &opts).unwrap();
    let client = Node::bind(any, Arc::new(b), TrustedKeys::new([ia]), &opts).unwrap();
    (Arc::new(server), client)
}

/// The reason a connection was closed with, once it is.
async fn closed_with(conn: &quinn::Connection) -> Option<u64> {
    match tokio::time::timeout(Duration::from_secs(5), conn.closed()).await {
        Ok(quinn::ConnectionError::ApplicationClosed(c)) => Some(c.error_code.into_inner()),
        _ => None,
    }
}

#[tokio::test]
async fn each_protocol_reaches_its_own_service_and_unserved_ones_are_closed() {
    let (server, client) = pair();
    let (addr, sid) = (server.local_addr().unwrap(), server.id());
    let router = Router::new(server.clone());
    let mut membership = router.route(alpn::MEMBERSHIP);
    let mut pipeline = router.route(alpn::PIPELINE);

    let to_pipeline = client.connect(addr, sid, alpn::PIPELINE).await.unwrap();
    let to_membership = client.connect(addr, sid, alpn::MEMBERSHIP).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), pipeline.accept()).await.unwrap().unwrap();
    assert_eq!(got.alpn, alpn::PIPELINE);
    assert_eq!(got.peer, client.id());
    let got = tokio::time::timeout(Duration::from_secs(5), membership.accept()).await.unwrap().unwrap();
    assert_eq!(got.alpn, alpn::MEMBERSHIP);
    // Nothing crossed over: each queue held exactly its own connection.
    assert!(tokio::time::timeout(Duration::from_millis(200), pipeline.accept()).await.is_err());
    drop((to_pipeline, to_membership));

    // A protocol the endpoint speaks but no service took: closed at once.
    let unserved = client.connect(addr, sid, alpn::CONTROL).await.unwrap();
    assert_eq!(closed_with(&unserved).await, Some(NOT_SERVED.into()));

    // A service that stopped (its queue dropped): its later connections are closed.
    drop(pipeline);
    let late = client.connect(addr, sid, alpn::PIPELINE).await.unwrap();
    assert_eq!(closed_with(&late).await, Some(NOT_SERVED.into()));

    // A restarted service takes its protocol over.
    let mut pipeline = router.route(alpn::PIPELINE);
    let _again = client.connect(addr, sid, alpn::PIPELINE).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), pipeline.accept()).await.unwrap().unwrap();
    assert_eq!(got.alpn, alpn::PIPELINE);
    server.close();
}
