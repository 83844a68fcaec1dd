//! Shoal's network layer: who a node is (an Ed25519 key), whom it talks to (only keys
//! it was told to trust, checked inside the TLS handshake — no CA), one QUIC endpoint
//! per node serving several protocols told apart by ALPN, the pipeline frame codec, and
//! mDNS discovery of the other nodes on the LAN.
//! Nothing here knows about models; the pipeline and cluster crates build on it.

pub mod discovery;
pub mod endpoint;
pub mod frame;
pub mod identity;
pub mod impair;
pub mod probe;
pub mod router;
pub mod tls;

pub use discovery::{
    Advert, Discovery, DiscoveryError, DiscoveryEvent, InterfaceFilter, TxtError, PROTOCOL_VERSION, SERVICE_TYPE,
};
pub use endpoint::{alpn, close_when_revoked, NetError, Node, TransportOptions};
pub use frame::{wall_us, Dtype, Frame, FrameError, FrameKind, FrameLimits};
pub use identity::{Identity, IdentityError, NodeId};
pub use impair::Impairment;
pub use probe::{LinkMeasure, ProbeError, ProbeOptions};
pub use router::{Incoming, Router};
pub use tls::TrustedKeys;
