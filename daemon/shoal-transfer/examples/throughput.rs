//! Throughput of a shard transfer over loopback QUIC against a raw quinn stream of the
//! same bytes (the shard's data chunks, holes left out), on the same pair of pinned
//! endpoints, alternating rounds in one run because these machines are noisy. A third
//! row writes the raw stream to a file and fsyncs it once: the share of the gap that is
//! the disk rather than the protocol (hashing, checkpoints, the final whole-file check).
//!
//! `cargo run --release -p shoal-transfer --example throughput [MODEL] [START END] [ROUNDS]`
//! (default: the SmolLM2 test model, layers 10..20, 5 rounds).

use shoal_gguf::{Chunk, Manifest, ShardCache, SourceHash};
use shoal_net::{alpn, Identity, Node, NodeId, TransportOptions, TrustedKeys};
use shoal_transfer::{fetch, Server, ServerOptions};
use shoal_types::LayerRange;
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .first()
        .map(PathBuf::from)
        .unwrap_or_else(|| shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let range = match (args.get(1), args.get(2)) {
        (Some(a), Some(b)) => LayerRange::new(a.parse()?, b.parse()?),
        _ => LayerRange::new(10, 20),
    };
    let rounds: usize = args.get(3).map(|r| r.parse()).transpose()?.unwrap_or(5);

    let dir = tempfile::tempdir()?;
    let source = SourceHash::of_file(&model)?;
    let (ia, ib) = (Arc::new(Identity::generate()?), Arc::new(Identity::generate()?));
    let trusted = [ia.id(), ib.id()];
    let any = "127.0.0.1:0".parse()?;
    let opts = TransportOptions::default();
    let a = Arc::new(Node::bind(any, ia.clone(), TrustedKeys::new(trusted), &opts)?);
    let b = Node::bind(any, ib, TrustedKeys::new(trusted), &opts)?;
    let cache = ShardCache::new(dir.path().join("holder"));
    // Build first: the bench times the transfer, not the build.
    let (shard, manifest) = cache.build_for(&source, &model, range)?;
    let server = Server::new(cache, Arc::new(HashMap::from([(source, model.clone())])), ServerOptions::default());
    let raw = RawSource { path: shard.path.clone(), manifest: manifest.clone() };
    let an = a.clone();
    tokio::spawn(async move {
        while let Some(acc) = an.accept().await {
            if acc.alpn == alpn::SHARD {
                let s = server.clone();
                tokio::spawn(async move { s.serve(acc.conn).await });
            } else if acc.alpn == alpn::PROBE {
                // The raw baseline rides on the probe ALPN (the only other one this
                // example serves): the same bytes, no manifest, no hashing, no file.
                let r = raw.clone();
                tokio::spawn(async move { r.serve(acc.conn).await });
            }
        }
    });
    let addr = a.local_addr()?;
    let peer = ia.id();

    println!(
        "shard {range} of {}: {:.1} MB ({:.1} MB of data chunks, {} chunks, {} holes); model {:.1} MB",
        model.display(),
        mb(manifest.bytes),
        mb(manifest.data_bytes()),
        manifest.chunks.len(),
        manifest.chunks.iter().filter(|c| **c == Chunk::Hole).count(),
        mb(std::fs::metadata(&model)?.len()),
    );
    let (mut shoal_s, mut raw_s, mut file_s) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..=rounds {
        let into = ShardCache::new(dir.path().join(format!("receiver-{round}")));
        let t = Instant::now();
        let got = fetch(&b, peer, addr, source, range, &into, &mut |_| {}).await?;
        let shoal = t.elapsed().as_secs_f64();
        assert_eq!(got.stats.data_bytes, manifest.data_bytes());
        let t = Instant::now();
        let n = raw_fetch(&b, peer, addr, None).await?;
        let rawt = t.elapsed().as_secs_f64();
        assert_eq!(n, manifest.data_bytes());
        let out = dir.path().join(format!("raw-{round}"));
        let t = Instant::now();
        raw_fetch(&b, peer, addr, Some(&out)).await?;
        let filet = t.elapsed().as_secs_f64();
        std::fs::remove_file(&out)?;
        std::fs::remove_dir_all(into.dir())?;
        // Round 0 warms the page cache and the congestion window; not counted.
        if round > 0 {
            println!(
                "round {round}: shoal {:.0} MB/s, raw {:.0} MB/s, raw to file {:.0} MB/s",
                mbps(n, shoal),
                mbps(n, rawt),
                mbps(n, filet)
            );
            shoal_s.push(shoal);
            raw_s.push(rawt);
            file_s.push(filet);
        }
    }
    let (s, r, f) = (median(&mut shoal_s), median(&mut raw_s), median(&mut file_s));
    let n = manifest.data_bytes();
    println!("median of {rounds} (data bytes / time, connection setup included):");
    println!("  shoal-transfer           {:6.0} MB/s  {:.3} s", mbps(n, s), s);
    println!("  raw quinn stream         {:6.0} MB/s  {:.3} s", mbps(n, r), r);
    println!("  raw stream to file+fsync {:6.0} MB/s  {:.3} s", mbps(n, f), f);
    println!("  shoal/raw = {:.2}, shoal/raw-to-file = {:.2}", r / s, f / s);
    Ok(())
}

#[derive(Clone)]
struct RawSource {
    path: PathBuf,
    manifest: Manifest,
}

impl RawSource {
    /// One stream per request: write the data chunks back to back.
    async fn serve(self, conn: quinn::Connection) {
        while let Ok((mut send, _recv)) = conn.accept_bi().await {
            let mut file = match std::fs::File::open(&self.path) {
                Ok(f) => f,
                Err(_) => return,
            };
            let mut buf = vec![0u8; self.manifest.chunk_bytes as usize];
            for i in 0..self.manifest.chunks.len() {
                if self.manifest.chunks[i] == Chunk::Hole {
                    continue;
                }
                let Some((off, len)) = self.manifest.chunk_span(i) else { return };
                let b = &mut buf[..len as usize];
                if file.seek(SeekFrom::Start(off)).and_then(|_| file.read_exact(b)).is_err() {
                    return;
                }
                if send.write_all(b).await.is_err() {
                    return;
                }
            }
            let _ = send.finish();
            let _ = send.stopped().await;
        }
    }
}

/// Read a raw stream to its end (into the file `to`, synced, if given); its length.
async fn raw_fetch(node: &Node, peer: NodeId, addr: std::net::SocketAddr, to: Option<&Path>) -> Result<u64, Error> {
    let conn = node.connect(addr, peer, alpn::PROBE).await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(b"go").await?;
    let mut file = to.map(std::fs::File::create).transpose()?;
    let mut n = 0u64;
    while let Some(chunk) = recv.read_chunk(1 << 20, true).await? {
        n += chunk.bytes.len() as u64;
        if let Some(f) = file.as_mut() {
            // Blocking, briefly, on the runtime: a bench's shortcut.
            f.write_all(&chunk.bytes)?;
        }
    }
    if let Some(f) = file {
        f.sync_all()?;
    }
    conn.close(0u32.into(), b"done");
    Ok(n)
}

fn mb(n: u64) -> f64 {
    n as f64 / 1e6
}

fn mbps(n: u64, secs: f64) -> f64 {
    mb(n) / secs
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
