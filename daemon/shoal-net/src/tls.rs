//! Mutual TLS with pinned keys. Both sides present self-signed certificates over their
//! Ed25519 node key; each side accepts the handshake only if the peer's key is in its
//! trusted set (and, when dialling, is the very node it meant to reach). No CA, no
//! "accept any certificate": an unknown key fails inside the handshake.
//!
//! No TLS session is ever resumed, in either direction: a resumed TLS 1.3 session
//! restores the peer's certificate from the session store without asking the verifier
//! again, so a key removed from [`TrustedKeys`] after its session was saved would get
//! back in. Every handshake is a full one, checked against the set as it is now.

use crate::identity::{Identity, NodeId};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, Error, PeerIncompatible, SignatureScheme};
use std::collections::HashSet;
use std::sync::{Arc, RwLock};

/// DER prefix of an Ed25519 SubjectPublicKeyInfo (RFC 8410), followed by the 32-byte key.
const ED25519_SPKI_PREFIX: [u8; 12] = [0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00];

/// The set of node keys a node accepts; shared and updatable (membership changes it).
/// Clones share one set. A removal wakes every [`TrustedKeys::revoked`] waiter, so
/// connections of a removed key can be closed at once rather than at the next poll.
#[derive(Clone, Debug)]
pub struct TrustedKeys(Arc<Trusted>);

#[derive(Debug)]
struct Trusted {
    keys: RwLock<HashSet<NodeId>>,
    /// Counts removals. Waiters subscribe before they look at `keys`, so a removal
    /// that lands between the look and the wait still wakes them.
    removals: tokio::sync::watch::Sender<u64>,
}

impl Default for TrustedKeys {
    fn default() -> Self {
        Self::new([])
    }
}

impl TrustedKeys {
    /// A set holding `ids`.
    pub fn new(ids: impl IntoIterator<Item = NodeId>) -> Self {
        let (removals, _) = tokio::sync::watch::channel(0);
        Self(Arc::new(Trusted { keys: RwLock::new(ids.into_iter().collect()), removals }))
    }

    /// Is `id` trusted?
    pub fn contains(&self, id: &NodeId) -> bool {
        // A poisoned lock only means a writer panicked mid-insert; the set is still a set.
        self.0.keys.read().unwrap_or_else(|e| e.into_inner()).contains(id)
    }

    /// Trust `id` from now on.
    pub fn insert(&self, id: NodeId) {
        self.0.keys.write().unwrap_or_else(|e| e.into_inner()).insert(id);
    }

    /// Stop trusting `id`: new handshakes fail at once, and every
    /// [`TrustedKeys::revoked`] waiter for `id` wakes (see
    /// [`crate::endpoint::close_when_revoked`] for open connections).
    pub fn remove(&self, id: &NodeId) {
        let removed = self.0.keys.write().unwrap_or_else(|e| e.into_inner()).remove(id);
        if removed {
            // send_modify updates the value even when nobody is subscribed.
            self.0.removals.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Resolves once `id` is not trusted (at once if it is not trusted now). Woken by
    /// [`TrustedKeys::remove`] itself: no polling, no delay.
    pub async fn revoked(&self, id: &NodeId) {
        // Subscribe first: a removal after this line bumps the counter and wakes us.
        let mut removals = self.0.removals.subscribe();
        while self.contains(id) {
            // changed() fails only once the sender is dropped, and `self` holds it.
            if removals.changed().await.is_err() {
                return;
            }
        }
    }
}

/// The node id in a peer's certificate, if it is an Ed25519 certificate.
pub fn node_id_of(cert: &CertificateDer<'_>) -> Result<NodeId, Error> {
    let ee =
        webpki::EndEntityCert::try_from(cert).map_err(|_| Error::InvalidCertificate(CertificateError::BadEncoding))?;
    let spki = ee.subject_public_key_info();
    let key = spki
        .as_ref()
        .strip_prefix(&ED25519_SPKI_PREFIX[..])
        .and_then(|k| <[u8; 32]>::try_from(k).ok())
        .ok_or(Error::PeerIncompatible(PeerIncompatible::NoSignatureSchemesInCommon))?;
    Ok(NodeId(key))
}

/// Checks a peer certificate against the trusted set (and an expected id).
#[derive(Debug)]
struct PinnedKeys {
    /// The keys accepted; `None` on a node's open join endpoint, which accepts any
    /// key (still proven by the handshake signature) and speaks only the join protocol.
    trusted: Option<TrustedKeys>,
    /// When dialling: the node we mean to reach.
    expected: Option<NodeId>,
    algs: WebPkiSupportedAlgorithms,
}

impl PinnedKeys {
    fn check(&self, cert: &CertificateDer<'_>, intermediates: &[CertificateDer<'_>]) -> Result<NodeId, Error> {
        if !intermediates.is_empty() {
            return Err(Error::InvalidCertificate(CertificateError::BadEncoding));
        }
        let id = node_id_of(cert)?;
        if self.expected.is_some_and(|e| e != id) || self.trusted.as_ref().is_some_and(|t| !t.contains(&id)) {
            tracing::warn!(peer = %id, "refused a peer whose key is not trusted");
            return Err(Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure));
        }
        Ok(id)
    }

    fn verify13(
        &self,
        msg: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls13_signature(msg, cert, dss, &self.algs)
    }
}

impl ServerCertVerifier for PinnedKeys {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        self.check(end_entity, intermediates).map(|_| ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        // QUIC is TLS 1.3 only.
        Err(Error::PeerIncompatible(PeerIncompatible::Tls12NotOffered))
    }

    fn verify_tls13_signature(
        &self,
        msg: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.verify13(msg, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

impl ClientCertVerifier for PinnedKeys {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        self.check(end_entity, intermediates).map(|_| ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        Err(Error::PeerIncompatible(PeerIncompatible::Tls12NotOffered))
    }

    fn verify_tls13_signature(
        &self,
        msg: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.verify13(msg, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn verifier(trusted: Option<&TrustedKeys>, expected: Option<NodeId>) -> Arc<PinnedKeys> {
    Arc::new(PinnedKeys { trusted: trusted.cloned(), expected, algs: provider().signature_verification_algorithms })
}

/// rustls server side: requires a client certificate with a trusted key (any key
/// when `trusted` is `None`: the join endpoint).
pub(crate) fn server_config(
    identity: &Identity,
    trusted: Option<&TrustedKeys>,
    alpns: &[&[u8]],
) -> Result<rustls::ServerConfig, Error> {
    let mut c = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier(trusted, None))
        .with_single_cert(identity.cert_chain(), identity.private_key())?;
    c.alpn_protocols = alpns.iter().map(|a| a.to_vec()).collect();
    // No resumption (see the module docs): no stateful session cache, no tickets (the
    // default ticketer already makes none), and so no 0-RTT either.
    c.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    c.send_tls13_tickets = 0;
    c.max_early_data_size = 0;
    Ok(c)
}

/// rustls client side, to reach node `peer` speaking `alpn` (`peer` need not be
/// trusted when `trusted` is `None`: the join endpoint).
pub(crate) fn client_config(
    identity: &Identity,
    trusted: Option<&TrustedKeys>,
    peer: NodeId,
    alpn: &[u8],
) -> Result<rustls::ClientConfig, Error> {
    let mut c = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier(trusted, Some(peer)))
        .with_client_auth_cert(identity.cert_chain(), identity.private_key())?;
    c.alpn_protocols = vec![alpn.to_vec()];
    // Never offer a saved session (nor 0-RTT data on one): every handshake is full.
    c.resumption = rustls::client::Resumption::disabled();
    c.enable_early_data = false;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    fn id() -> Identity {
        Identity::generate().expect("a fresh key")
    }

    #[test]
    fn pinned_configs_neither_resume_nor_take_early_data() {
        let me = id();
        let trusted = TrustedKeys::new([me.id()]);
        for t in [Some(&trusted), None] {
            let s = server_config(&me, t, &[b"x"]).unwrap();
            assert_eq!(s.send_tls13_tickets, 0);
            assert_eq!(s.max_early_data_size, 0);
            assert!(!s.session_storage.can_cache(), "a server session cache is on");
            assert!(!s.ticketer.enabled(), "a ticketer is on");
            let c = client_config(&me, t, me.id(), b"x").unwrap();
            assert!(!c.enable_early_data);
            assert!(
                format!("{:?}", c.resumption).contains("NoClientSessionStorage"),
                "client resumes: {:?}",
                c.resumption
            );
        }
    }

    /// The waiter is woken by the removal itself: polled before, it is pending; polled
    /// right after `remove`, with no time passing, it is ready.
    #[test]
    fn revoked_wakes_on_removal_without_polling() {
        let (a, b) = (id().id(), id().id());
        let keys = TrustedKeys::new([a, b]);
        let mut cx = Context::from_waker(Waker::noop());
        let mut wait = std::pin::pin!(keys.revoked(&a));
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        keys.remove(&b);
        assert!(wait.as_mut().poll(&mut cx).is_pending(), "woke for another key");
        keys.insert(b);
        keys.remove(&a);
        assert_eq!(wait.as_mut().poll(&mut cx), Poll::Ready(()));
        // Not trusted now: at once.
        let mut gone = std::pin::pin!(keys.revoked(&a));
        assert_eq!(gone.as_mut().poll(&mut cx), Poll::Ready(()));
    }
}
