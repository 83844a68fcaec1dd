//! Handshake floods on loopback: a plain UDP socket sends real, well-formed QUIC v1
//! Initial packets (each a fresh connection id, a valid ClientHello, 1200 bytes) and
//! never answers, as a spoofed source cannot. Each one the endpoint admits holds a
//! handshake slot until it times out; a member must still get in meanwhile.

use rustls::quic::{Suite, Version};
use rustls::Side;
use shoal_net::{alpn, Identity, Node, NodeId, TransportOptions, TrustedKeys};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How many Initials a flood sends (bounded, loopback only).
const FLOOD: usize = 20_000;

/// Makes QUIC v1 Initial datagrams carrying one ClientHello, each under a new
/// destination connection id (so each is a new handshake to the server).
struct Forge {
    suite: Suite,
    scid: [u8; 8],
    hello: Vec<u8>,
}

impl Forge {
    fn new() -> Forge {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        config.alpn_protocols = vec![alpn::MEMBERSHIP.to_vec()];
        let scid = *b"flooder!";
        // Transport parameters: initial_source_connection_id (0x0f), which the server
        // checks against the packet's source id; the rest may default.
        let mut params = vec![0x0f, scid.len() as u8];
        params.extend(scid);
        let name = rustls::pki_types::ServerName::try_from("shoal").unwrap();
        let mut tls = rustls::quic::ClientConnection::new(Arc::new(config), Version::V1, name, params).unwrap();
        let mut hello = Vec::new();
        tls.write_hs(&mut hello);
        assert!(!hello.is_empty() && hello.len() < 900, "ClientHello of {} bytes", hello.len());
        let suite = rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256.tls13().unwrap().quic_suite().unwrap();
        Forge { suite, scid, hello }
    }

    /// One protected Initial packet, padded to 1200 bytes, to destination id `dcid`.
    fn initial(&self, dcid: &[u8]) -> Vec<u8> {
        const PN_LEN: usize = 4;
        const TAG: usize = 16;
        let keys = self.suite.keys(dcid, Side::Client, Version::V1);
        // CRYPTO frame at offset 0 (lengths < 16384: two-byte varint), then PADDING.
        let mut payload = vec![0x06, 0x00, 0x40 | (self.hello.len() >> 8) as u8, self.hello.len() as u8];
        payload.extend(&self.hello);
        let mut header = vec![0xc0 | (PN_LEN as u8 - 1)]; // long header, Initial
        header.extend(1u32.to_be_bytes()); // QUIC v1
        header.push(dcid.len() as u8);
        header.extend(dcid);
        header.push(self.scid.len() as u8);
        header.extend(self.scid);
        header.push(0); // no token
        let length_at = header.len();
        payload.resize(1200 - length_at - 2 - PN_LEN - TAG, 0);
        let length = PN_LEN + payload.len() + TAG;
        header.extend([0x40 | (length >> 8) as u8, length as u8]);
        let pn_at = header.len();
        header.extend([0u8; PN_LEN]); // packet number 0
        let tag = keys.local.packet.encrypt_in_place(0, &header, &mut payload).unwrap();
        payload.extend(tag.as_ref());
        // Header protection samples the ciphertext 4 bytes after the packet number's start.
        let sample = payload[..keys.local.header.sample_len()].to_vec();
        let (first, rest) = header.split_at_mut(1);
        keys.local.header.encrypt_in_place(&sample, &mut first[0], &mut rest[pn_at - 1..pn_at - 1 + PN_LEN]).unwrap();
        header.extend(payload);
        header
    }
}

/// Send [`FLOOD`] Initials to `to` from one loopback socket that never reads;
/// `started` fires after the first 2,000.
fn flood(to: SocketAddr, started: tokio::sync::oneshot::Sender<()>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let forge = Forge::new();
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut started = Some(started);
        let mut sent = 0;
        // Distinct ids per run and per packet (the count is all that must differ).
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        for i in 0..FLOOD as u64 {
            let mut dcid = [0u8; 16];
            dcid[..8].copy_from_slice(&seed.to_be_bytes());
            dcid[8..].copy_from_slice(&i.to_be_bytes());
            // A full socket buffer drops datagrams; that is part of a flood.
            if socket.send_to(&forge.initial(&dcid), to).is_ok() {
                sent += 1;
            }
            if i == 2_000 {
                if let Some(s) = started.take() {
                    let _ = s.send(());
                }
            }
        }
        sent
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
    let conn = tokio::time::timeout(Duration::from_secs(10), client.connect(addr, server_id, proto))
        .await
        .unwrap_or_else(|_| panic!("{what}: no connection within 10 s of a flood"))
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
