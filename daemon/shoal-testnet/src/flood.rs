//! A lab tool: floods of spoofed QUIC handshakes. Real, well-formed QUIC v1 Initial
//! packets (each under a fresh connection id, with a valid ClientHello, 1200 bytes) from
//! a socket that never answers, as a spoofed source cannot. Tests and benches aim them at
//! a node's endpoints to check that members still get in; only ever at loopback or at
//! namespace hosts the caller created.

use rustls::quic::{Suite, Version};
use rustls::Side;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;

/// Makes QUIC v1 Initial datagrams carrying one ClientHello, each under a new
/// destination connection id (so each is a new handshake to the server).
pub struct Forge {
    suite: Suite,
    scid: [u8; 8],
    hello: Vec<u8>,
}

impl Forge {
    /// A forge whose ClientHello offers `alpn`.
    pub fn new(alpn: &[u8]) -> Forge {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("a fixed, valid rustls configuration")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        config.alpn_protocols = vec![alpn.to_vec()];
        let scid = *b"flooder!";
        // Transport parameters: initial_source_connection_id (0x0f), which the server
        // checks against the packet's source id; the rest may default.
        let mut params = vec![0x0f, scid.len() as u8];
        params.extend(scid);
        let name = rustls::pki_types::ServerName::try_from("shoal").expect("a fixed, valid rustls configuration");
        let mut tls = rustls::quic::ClientConnection::new(Arc::new(config), Version::V1, name, params)
            .expect("a fixed, valid rustls configuration");
        let mut hello = Vec::new();
        tls.write_hs(&mut hello);
        assert!(!hello.is_empty() && hello.len() < 900, "ClientHello of {} bytes", hello.len());
        let suite = rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256
            .tls13()
            .expect("a fixed, valid rustls configuration")
            .quic_suite()
            .expect("a fixed, valid rustls configuration");
        Forge { suite, scid, hello }
    }

    /// One protected Initial packet, padded to 1200 bytes, to destination id `dcid`.
    pub fn initial(&self, dcid: &[u8]) -> Vec<u8> {
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
        let tag =
            keys.local.packet.encrypt_in_place(0, &header, &mut payload).expect("a fixed, valid rustls configuration");
        payload.extend(tag.as_ref());
        // Header protection samples the ciphertext 4 bytes after the packet number's start.
        let sample = payload[..keys.local.header.sample_len()].to_vec();
        let (first, rest) = header.split_at_mut(1);
        keys.local
            .header
            .encrypt_in_place(&sample, &mut first[0], &mut rest[pn_at - 1..pn_at - 1 + PN_LEN])
            .expect("a fixed, valid rustls configuration");
        header.extend(payload);
        header
    }
}

/// Send `count` Initials to each of `targets` (round robin) from one socket bound to
/// `from` that never reads; returns how many datagrams left. `progress` is called after
/// each thousand. A full socket buffer drops datagrams: that is part of a flood.
pub fn send_initials(
    from: SocketAddr,
    targets: &[SocketAddr],
    count: usize,
    alpn: &[u8],
    mut progress: impl FnMut(usize),
) -> std::io::Result<usize> {
    let forge = Forge::new(alpn);
    let socket = UdpSocket::bind(from)?;
    let mut sent = 0;
    // Distinct ids per run and per packet (the count is all that must differ).
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    for i in 0..count as u64 {
        let mut dcid = [0u8; 16];
        dcid[..8].copy_from_slice(&seed.to_be_bytes());
        dcid[8..].copy_from_slice(&i.to_be_bytes());
        for to in targets {
            if socket.send_to(&forge.initial(&dcid), to).is_ok() {
                sent += 1;
            }
        }
        if i % 1000 == 999 {
            progress(i as usize + 1);
        }
    }
    Ok(sent)
}
