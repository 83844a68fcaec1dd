//! Members on 127.0.0.1 that trust each other, each serving shards from a cache of its
//! own, and the real test model (from the model cache; see `scripts/setup.sh`).
#![allow(dead_code)]

use shoal_gguf::{ShardCache, SourceHash};
use shoal_net::{alpn, Identity, Node, NodeId, TransportOptions, TrustedKeys};
use shoal_transfer::{Holder, Server, ServerOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

pub const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The real test model; fails with instructions when it is missing.
pub fn model() -> PathBuf {
    let p = shoal_gguf::models_dir().join(MODEL);
    assert!(p.exists(), "test model {} is missing: run scripts/setup.sh (or set SHOAL_MODELS)", p.display());
    p
}

/// Its content hash, computed once per test binary.
pub fn model_hash() -> SourceHash {
    static HASH: OnceLock<SourceHash> = OnceLock::new();
    *HASH.get_or_init(|| SourceHash::of_file(&model()).unwrap())
}

/// A member: its endpoint, its shard server (run on every `shoal/shard/1` connection)
/// and its cache directory.
pub struct Member {
    pub node: Arc<Node>,
    pub id: NodeId,
    pub server: Server,
    pub cache: ShardCache,
    pub dir: tempfile::TempDir,
}

impl Member {
    pub fn holder(&self) -> Holder {
        Holder { peer: self.id, addr: self.node.local_addr().unwrap() }
    }
}

pub fn identities(n: usize) -> Vec<Arc<Identity>> {
    (0..n).map(|_| Arc::new(Identity::generate().unwrap())).collect()
}

/// A member with `identity`, trusting `trusted`, holding the models `sources` names.
pub fn member(identity: Arc<Identity>, trusted: &[NodeId], sources: HashMap<SourceHash, PathBuf>) -> Member {
    member_with(identity, trusted, sources, ServerOptions::default())
}

pub fn member_with(
    identity: Arc<Identity>,
    trusted: &[NodeId],
    sources: HashMap<SourceHash, PathBuf>,
    opts: ServerOptions,
) -> Member {
    member_serving(identity, trusted, Arc::new(sources), opts)
}

/// [`member_with`] over any [`shoal_transfer::Sources`].
pub fn member_serving(
    identity: Arc<Identity>,
    trusted: &[NodeId],
    sources: Arc<dyn shoal_transfer::Sources>,
    opts: ServerOptions,
) -> Member {
    let dir = tempfile::tempdir().unwrap();
    let id = identity.id();
    let node = Arc::new(
        Node::bind(
            "127.0.0.1:0".parse().unwrap(),
            identity,
            TrustedKeys::new(trusted.iter().copied()),
            &TransportOptions::default(),
        )
        .unwrap(),
    );
    let cache = ShardCache::new(dir.path().join("shards"));
    let server = Server::new(cache.clone(), sources, opts);
    let (n, s) = (node.clone(), server.clone());
    tokio::spawn(async move {
        while let Some(acc) = n.accept().await {
            if acc.alpn == alpn::SHARD {
                let s = s.clone();
                tokio::spawn(async move { s.serve(acc.conn).await });
            }
        }
    });
    Member { node, id, server, cache, dir }
}

/// `n` members that all trust each other, none holding anything.
pub fn members(n: usize) -> Vec<Member> {
    let ids = identities(n);
    let all: Vec<NodeId> = ids.iter().map(|i| i.id()).collect();
    ids.into_iter().map(|i| member(i, &all, HashMap::new())).collect()
}

/// The model as a source map (a member holding the full file).
pub fn holding_model() -> HashMap<SourceHash, PathBuf> {
    HashMap::from([(model_hash(), model())])
}

/// The shard of `range` built locally from the model, as bytes: what every transfer
/// must reproduce.
pub fn local_shard(dir: &Path, range: shoal_types::LayerRange) -> Vec<u8> {
    let (g, meta) = shoal_gguf::open_model(&model()).unwrap();
    let dest = dir.join(format!("local-{}-{}.gguf", range.start, range.end));
    shoal_gguf::shard::write_shard(&g, &meta, range, &dest).unwrap();
    std::fs::read(dest).unwrap()
}

/// A progress callback that ignores progress.
pub fn quiet() -> impl FnMut(&shoal_transfer::Progress) + Send {
    |_| {}
}
