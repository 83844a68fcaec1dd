//! A node's identity: an Ed25519 key pair created on first start and kept in the data
//! directory (readable by the owner only). Its public key *is* the node id; the TLS
//! certificate is a self-signed wrapper around it, regenerated at every start.

use rcgen::KeyPair;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::io::Write;
use std::path::{Path, PathBuf};

/// File name of the node key inside the data directory (PKCS#8, DER).
pub const KEY_FILE: &str = "node.key";

pub use shoal_types::NodeId;

/// Why an identity could not be created, loaded or parsed.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// Reading or writing the key file failed.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The key file is not an Ed25519 PKCS#8 key.
    #[error("{path}: not an Ed25519 node key ({why})")]
    BadKey { path: PathBuf, why: String },
    /// The key file can be read by others than its owner.
    #[error("{path}: node key is readable by others (mode {mode:o}); run `chmod 600` on it")]
    Permissions { path: PathBuf, mode: u32 },
    /// A node id string is not 64 hex digits.
    #[error(transparent)]
    BadNodeId(#[from] shoal_types::BadNodeId),
    /// Certificate generation failed.
    #[error("cannot create the node certificate: {0}")]
    Cert(String),
}

/// The key pair and certificate a node presents.
pub struct Identity {
    /// Public key.
    id: NodeId,
    /// Private key, PKCS#8 DER.
    pkcs8: Vec<u8>,
    /// Self-signed certificate over the key.
    cert: CertificateDer<'static>,
}

impl Identity {
    /// A fresh random identity (tests, and first start).
    pub fn generate() -> Result<Identity, IdentityError> {
        let kp = KeyPair::generate_for(&rcgen::PKCS_ED25519).map_err(|e| IdentityError::Cert(e.to_string()))?;
        Identity::from_key_pair(kp)
    }

    /// Load the key from `dir/node.key`, creating it (mode 0600) on first start.
    pub fn load_or_create(dir: &Path) -> Result<Identity, IdentityError> {
        let path = dir.join(KEY_FILE);
        let io = |source| IdentityError::Io { path: path.clone(), source };
        match std::fs::read(&path) {
            Ok(der) => {
                check_permissions(&path)?;
                let kp = KeyPair::try_from(der.as_slice())
                    .map_err(|e| IdentityError::BadKey { path: path.clone(), why: e.to_string() })?;
                if kp.algorithm() != &rcgen::PKCS_ED25519 {
                    return Err(IdentityError::BadKey { path, why: "not Ed25519".into() });
                }
                Identity::from_key_pair(kp)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(dir).map_err(io)?;
                let id = Identity::generate()?;
                // Two processes starting at once (a node and a CLI command) must end up
                // with one key: the first to publish it wins, the other loads it.
                match write_private(&path, &id.pkcs8) {
                    Ok(()) => Ok(id),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Identity::load_or_create(dir),
                    Err(e) => Err(io(e)),
                }
            }
            Err(e) => Err(io(e)),
        }
    }

    fn from_key_pair(kp: KeyPair) -> Result<Identity, IdentityError> {
        let raw: [u8; 32] = kp
            .public_key_raw()
            .try_into()
            .map_err(|_| IdentityError::Cert("unexpected Ed25519 public key length".into()))?;
        let cert = rcgen::CertificateParams::new(vec!["shoal".to_string()])
            .and_then(|p| p.self_signed(&kp))
            .map_err(|e| IdentityError::Cert(e.to_string()))?;
        Ok(Identity { id: NodeId(raw), pkcs8: kp.serialize_der(), cert: cert.der().clone() })
    }

    /// The node id (public key).
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The key of this node's QUIC stateless resets: derived from its private key, so it
    /// is the same after a restart. A node that crashed and came back (or a laptop that
    /// woke) then answers the packets its peers still send on its previous run's
    /// connections with a reset they accept, and they reconnect at once instead of
    /// writing into a dead connection until their idle timeout (10 s). Knowing it lets
    /// one reset this node's connections, which the private key already allows.
    pub(crate) fn reset_key(&self) -> [u8; 32] {
        blake3::derive_key("shoal 2026-12-06 QUIC stateless reset key", &self.pkcs8)
    }

    /// The key of this node's QUIC connection ids, derived like [`Identity::reset_key`]:
    /// a restarted node recognises the ids its previous run issued as its own, which is
    /// when quinn answers a packet for an unknown connection with a stateless reset
    /// (ids it cannot recognise are dropped silently).
    pub(crate) fn connection_id_key(&self) -> u64 {
        let k = blake3::derive_key("shoal 2026-12-06 QUIC connection id key", &self.pkcs8);
        u64::from_le_bytes([k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7]])
    }

    /// A secret of this node's own for `context` (a fixed string naming its use),
    /// derived from its private key: stable across restarts, and no other node (no
    /// member holding the cluster state either) can compute it. The admin page signs
    /// this node's sessions with one (security review F1).
    pub fn derive_key(&self, context: &'static str) -> [u8; 32] {
        blake3::derive_key(context, &self.pkcs8)
    }

    /// Certificate chain to present in TLS.
    pub(crate) fn cert_chain(&self) -> Vec<CertificateDer<'static>> {
        vec![self.cert.clone()]
    }

    /// Private key for TLS.
    pub(crate) fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.pkcs8.clone()))
    }
}

/// Write `bytes` to a new file only the owner can read, atomically; fails with
/// `AlreadyExists` if the file appeared meanwhile (it is never replaced).
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // A temporary name of this process's own, so concurrent writers do not mix bytes.
    let tmp = path.with_extension(format!("key.tmp{}", std::process::id()));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let mut f = opts.open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    // A hard link publishes the complete file under its name only if none exists.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked?;
    // The new name lives in the directory: without syncing it, a power cut can lose the
    // key the node already handed out as its identity.
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Make a directory's entries durable (a new or removed file name in it).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(if dir.as_os_str().is_empty() { Path::new(".") } else { dir })?.sync_all()
    }
    // Windows cannot open a directory as a file; NTFS journals its metadata.
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

fn check_permissions(path: &Path) -> Result<(), IdentityError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path)
            .map_err(|source| IdentityError::Io { path: path.to_owned(), source })?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(IdentityError::Permissions { path: path.to_owned(), mode: mode & 0o777 });
        }
    }
    let _ = path;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_is_created_once_and_kept_private() {
        let dir = tempfile::tempdir().unwrap();
        let a = Identity::load_or_create(dir.path()).unwrap();
        let b = Identity::load_or_create(dir.path()).unwrap();
        assert_eq!(a.id(), b.id());
        assert_ne!(a.id(), Identity::generate().unwrap().id());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let path = dir.path().join(KEY_FILE);
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
            let e = Identity::load_or_create(dir.path()).err().unwrap();
            assert!(matches!(e, IdentityError::Permissions { .. }), "{e}");
        }
    }

    #[test]
    fn garbage_key_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_private(&dir.path().join(KEY_FILE), b"not a key").unwrap();
        let e = Identity::load_or_create(dir.path()).err().unwrap();
        assert!(matches!(e, IdentityError::BadKey { .. }), "{e}");
    }

    #[test]
    fn node_ids_round_trip_through_text() {
        let id = Identity::generate().unwrap().id();
        assert_eq!(id.to_string().parse::<NodeId>().unwrap(), id);
        assert!("abc".parse::<NodeId>().is_err());
        assert!("zz".repeat(32).parse::<NodeId>().is_err());
        assert!("é".repeat(32).parse::<NodeId>().is_err());
    }
}
