//! The asker's side: receive a shard into the local cache, chunk by chunk.
//!
//! On disk beside the shard's final path `<dest>` while a transfer is unfinished:
//! `<dest>.part` (the file being filled, sparse: holes are never written),
//! `<dest>.part.json` (the manifest the holder sent, kept so that a later try can check
//! what is on disk before asking for anything) and `<dest>.part.progress` (how many
//! leading chunks are verified and synced). Every chunk is checked against its hash
//! before it is written; every [`SYNC_EVERY`] chunks, and when a transfer stops for any
//! reason it can see, the file is fsynced and the count recorded. A later try (after a
//! cut, a holder's fault or a restart of this process) checks the chunks past the
//! recorded count that reached the disk anyway and asks only for the rest. The
//! finished file is verified whole and renamed to `<dest>` beside its manifest, where
//! [`ShardCache::cached`] finds it.

use crate::wire::{read_exact, read_msg, write_msg, Refusal, Reply, Request, MAX_REPLY, TAG_ABORT, TAG_DATA, TAG_HOLE};
use crate::{locks, Holder, Sources};
use serde::{Deserialize, Serialize};
use shoal_gguf::shard::{install, verify, SHARD_FORMAT};
use shoal_gguf::{Chunk, Manifest, ShardCache, ShardError, ShardFile, SourceHash};
use shoal_net::{alpn, NetError, Node, NodeId};
use shoal_types::LayerRange;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Chunks received between two fsyncs of the file and its progress record: at most
/// this many (16 MiB) are received again after a power cut, and a 40 GB shard pays
/// ~2,500 fsyncs rather than 40,000.
pub const SYNC_EVERY: u64 = 16;

/// Reported after every chunk of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// The holder sending it.
    pub holder: NodeId,
    /// Chunks of the shard now held (verified), from the start of the file.
    pub chunks_done: u64,
    /// Chunks in the shard.
    pub chunks: u64,
    /// Chunk bytes received in this transfer so far.
    pub data_bytes: u64,
}

/// What a transfer moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// The first chunk asked for (chunks before it were already held).
    pub resumed_at: u64,
    /// Data chunks received.
    pub data_chunks: u64,
    /// Hole markers received.
    pub holes: u64,
    /// Chunk bytes received.
    pub data_bytes: u64,
    /// UDP payload bytes this node received on the transfer's connection (QUIC and TLS
    /// overhead, the manifest and the chunks).
    pub wire_bytes: u64,
}

/// Where a shard came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// It was in the cache already (verified): nothing moved.
    Cache,
    /// It was cut from a full model this node holds: nothing moved.
    Built,
    /// It was received from this member.
    Holder(NodeId),
}

/// A shard in the local cache, ready to load.
#[derive(Clone, Debug)]
pub struct Obtained {
    /// The file (its `built` flag: true when made by this call, by build or transfer).
    pub file: ShardFile,
    /// Its manifest.
    pub manifest: Manifest,
    /// How it got here.
    pub origin: Origin,
    /// What crossed the network (zeros unless [`Origin::Holder`]).
    pub stats: TransferStats,
}

/// Why a shard could not be obtained. Each error about a transfer names the holder.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// No connection to the holder (unreachable, or the handshake refused a key).
    #[error("cannot reach holder {holder}: {source}")]
    Connect {
        /// The holder.
        holder: NodeId,
        /// What failed.
        source: NetError,
    },
    /// The holder said no.
    #[error("holder {holder} refused: {refusal}")]
    Refused {
        /// The holder.
        holder: NodeId,
        /// Its reason.
        refusal: Refusal,
    },
    /// The connection or stream failed part way; what was verified is kept.
    #[error("transfer from {holder} cut at chunk {chunk}: {why}")]
    Cut {
        /// The holder.
        holder: NodeId,
        /// The first chunk not received.
        chunk: u64,
        /// What failed.
        why: String,
    },
    /// The manifest is inconsistent or is not for the shard asked.
    #[error("holder {holder} sent a bad manifest: {why}")]
    BadManifest {
        /// The holder.
        holder: NodeId,
        /// What is wrong with it.
        why: String,
    },
    /// A chunk's bytes do not hash to the manifest's entry (the holder's copy is
    /// corrupted, or the bytes were altered); nothing of it was written.
    #[error("holder {holder} sent chunk {chunk} (bytes {offset}..{end}) that does not match its manifest hash", end = offset + len)]
    CorruptChunk {
        /// The holder.
        holder: NodeId,
        /// Its index.
        chunk: u64,
        /// Its first byte in the shard.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// The holder sent something the protocol does not allow.
    #[error("holder {holder} broke the protocol at chunk {chunk}: {why}")]
    Protocol {
        /// The holder.
        holder: NodeId,
        /// Where.
        chunk: u64,
        /// What it did.
        why: String,
    },
    /// Every chunk matched but the whole file does not hash to the manifest's file
    /// hash (a manifest whose chunk list and file hash disagree); the file is dropped.
    #[error("the shard from {holder} does not match its manifest's file hash; discarded")]
    WholeFile {
        /// The holder.
        holder: NodeId,
    },
    /// The local cache failed (reading, building, installing).
    #[error(transparent)]
    Local(#[from] ShardError),
    /// Writing the partial file or its records failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// Every holder failed (or there was none); each one's error, in the order tried.
    #[error("no holder could supply layers {layers} of {model}: {}", list(.tried))]
    NoGoodHolder {
        /// The source model.
        model: SourceHash,
        /// The range.
        layers: LayerRange,
        /// What each holder's try ended with.
        tried: Vec<FetchError>,
    },
}

fn list(errors: &[FetchError]) -> String {
    if errors.is_empty() {
        return "no holder is known".into();
    }
    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> FetchError + '_ {
    move |source| FetchError::Io { path: path.to_owned(), source }
}

/// Run blocking file work off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(t) => t,
        // The closures here do not panic; if one did, carry its panic on.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// `<dest>.part`: the file a transfer fills.
pub fn part_path(dest: &Path) -> PathBuf {
    suffixed(dest, ".part")
}

fn part_manifest_path(dest: &Path) -> PathBuf {
    suffixed(dest, ".part.json")
}

fn record_path(dest: &Path) -> PathBuf {
    suffixed(dest, ".part.progress")
}

fn suffixed(p: &Path, suffix: &str) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// How far a transfer got: `<dest>.part.progress`.
#[derive(Serialize, Deserialize)]
struct Record {
    /// The file hash of the manifest the partial file belongs to.
    blake3: String,
    /// Leading chunks verified and synced.
    verified: u64,
}

/// Fetch the shard of `range` of `source` from the member `peer` at `addr` into
/// `cache` (content-keyed: [`ShardCache::content_path`]). A verified cached copy is
/// returned with nothing sent; an earlier unfinished transfer is resumed. `progress`
/// is called after every chunk.
pub async fn fetch(
    node: &Node,
    peer: NodeId,
    addr: SocketAddr,
    source: SourceHash,
    range: LayerRange,
    cache: &ShardCache,
    progress: &mut (dyn FnMut(&Progress) + Send),
) -> Result<Obtained, FetchError> {
    let dest = cache.content_path(&source, range);
    let _writing = locks::lock(&dest).await;
    if let Some(hit) = cached(cache, source, range).await? {
        return Ok(hit);
    }
    fetch_locked(node, Holder { peer, addr }, source, range, &dest, progress).await
}

/// [`fetch`] from the first of `holders` that delivers a good shard: a holder that
/// cannot be reached, refuses, breaks off or sends a corrupted chunk is left for the
/// next, which resumes where the last one stopped. Fails with every holder's error
/// when none delivers.
pub async fn fetch_from_any(
    node: &Node,
    holders: &[Holder],
    source: SourceHash,
    range: LayerRange,
    cache: &ShardCache,
    progress: &mut (dyn FnMut(&Progress) + Send),
) -> Result<Obtained, FetchError> {
    let dest = cache.content_path(&source, range);
    let _writing = locks::lock(&dest).await;
    if let Some(hit) = cached(cache, source, range).await? {
        return Ok(hit);
    }
    from_any_locked(node, holders, source, range, &dest, progress).await
}

/// What a stage node calls for the shard it must load: the cached copy if it verifies;
/// else cut it from the full model if this node holds it (`sources`), with no transfer;
/// else fetch it from one of `holders`.
pub async fn obtain(
    node: &Node,
    sources: &dyn Sources,
    holders: &[Holder],
    source: SourceHash,
    range: LayerRange,
    cache: &ShardCache,
    progress: &mut (dyn FnMut(&Progress) + Send),
) -> Result<Obtained, FetchError> {
    let dest = cache.content_path(&source, range);
    let _writing = locks::lock(&dest).await;
    if let Some(hit) = cached(cache, source, range).await? {
        return Ok(hit);
    }
    if let Some(model) = sources.model_path(&source) {
        let cache = cache.clone();
        let (file, manifest) = blocking(move || cache.build_for(&source, &model, range)).await?;
        let origin = if file.built { Origin::Built } else { Origin::Cache };
        return Ok(Obtained { file, manifest, origin, stats: TransferStats::default() });
    }
    from_any_locked(node, holders, source, range, &dest, progress).await
}

async fn cached(cache: &ShardCache, source: SourceHash, range: LayerRange) -> Result<Option<Obtained>, FetchError> {
    let cache = cache.clone();
    let hit = blocking(move || cache.cached(&source, range)).await?;
    Ok(hit.map(|(file, manifest)| Obtained { file, manifest, origin: Origin::Cache, stats: TransferStats::default() }))
}

async fn from_any_locked(
    node: &Node,
    holders: &[Holder],
    source: SourceHash,
    range: LayerRange,
    dest: &Path,
    progress: &mut (dyn FnMut(&Progress) + Send),
) -> Result<Obtained, FetchError> {
    let mut tried = Vec::new();
    for h in holders {
        match fetch_locked(node, *h, source, range, dest, progress).await {
            Ok(o) => return Ok(o),
            Err(e) => {
                tracing::warn!(holder = %h.peer, "shard transfer failed, trying the next holder: {e}");
                tried.push(e);
            }
        }
    }
    Err(FetchError::NoGoodHolder { model: source, layers: range, tried })
}

/// One transfer from `holder`, the caller holding the lock on `dest`.
async fn fetch_locked(
    node: &Node,
    holder: Holder,
    source: SourceHash,
    range: LayerRange,
    dest: &Path,
    progress: &mut (dyn FnMut(&Progress) + Send),
) -> Result<Obtained, FetchError> {
    let d = dest.to_owned();
    let resume = blocking(move || load_resume(&d)).await;
    let conn = node
        .connect(holder.addr, holder.peer, alpn::SHARD)
        .await
        .map_err(|source| FetchError::Connect { holder: holder.peer, source })?;
    let result = receive(&conn, holder.peer, source, range, dest, resume, progress).await;
    let wire = conn.stats().udp_rx.bytes;
    conn.close(0u32.into(), b"done");
    let mut o = result?;
    o.stats.wire_bytes = wire;
    Ok(o)
}

/// A partial file from an earlier try, if it and its records agree: its manifest and
/// how many leading chunks it holds, counting those that reached the disk after the
/// last record (checked against their hashes here, so none is received twice).
fn load_resume(dest: &Path) -> Option<(Manifest, u64)> {
    let record: Record = serde_json::from_slice(&fs::read(record_path(dest)).ok()?).ok()?;
    let m: Manifest = serde_json::from_slice(&fs::read(part_manifest_path(dest)).ok()?).ok()?;
    let n = m.chunks.len() as u64;
    if m.check().is_err() || m.blake3 != record.blake3 || record.verified > n {
        return None;
    }
    let mut file = File::open(part_path(dest)).ok()?;
    if file.metadata().ok()?.len() != m.bytes {
        return None;
    }
    let mut verified = record.verified;
    let mut buf = vec![0u8; m.chunk_bytes as usize];
    while verified < n {
        let i = verified as usize;
        if let Chunk::Data(hash) = m.chunks[i] {
            let (offset, len) = m.chunk_span(i)?;
            let buf = &mut buf[..len as usize];
            if file.seek(SeekFrom::Start(offset)).and_then(|_| file.read_exact(buf)).is_err()
                || blake3::hash(buf) != hash
            {
                break;
            }
        }
        // A hole chunk was never written, by this manifest: it reads as the zeros it is.
        verified += 1;
    }
    Some((m, verified))
}

/// Forget an unfinished transfer: its file and records.
fn clear_partial(dest: &Path) {
    for p in [record_path(dest), part_manifest_path(dest), part_path(dest)] {
        let _ = fs::remove_file(p);
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = suffixed(path, ".tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, path)
}

fn write_record(dest: &Path, blake3: &str, verified: u64) -> Result<(), FetchError> {
    let rec = Record { blake3: blake3.to_string(), verified };
    // Invariant: a string and an integer always serialise.
    let json = serde_json::to_vec(&rec).expect("a record serialises");
    let path = record_path(dest);
    write_atomic(&path, &json).map_err(io_err(&path))
}

/// Open the partial file for `m`: a fresh one (sparse, full length) when starting
/// from chunk 0, with the manifest and a zero record beside it.
fn open_part(dest: &Path, m: &Manifest, fresh: bool) -> Result<File, FetchError> {
    let part = part_path(dest);
    if let Some(dir) = dest.parent() {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
    }
    let file =
        OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&part).map_err(io_err(&part))?;
    if fresh {
        // Truncate first: a longer file's tail would otherwise keep its old blocks.
        file.set_len(0).and_then(|_| file.set_len(m.bytes)).map_err(io_err(&part))?;
        file.sync_all().map_err(io_err(&part))?;
        // Invariant: a manifest is strings, integers and a list of them.
        let json = serde_json::to_vec(m).expect("a manifest serialises");
        let mpath = part_manifest_path(dest);
        write_atomic(&mpath, &json).map_err(io_err(&mpath))?;
        write_record(dest, &m.blake3, 0)?;
    }
    Ok(file)
}

/// A chunk write on the blocking pool; gives back the file and the buffer.
type PendingWrite = tokio::task::JoinHandle<(File, Vec<u8>, io::Result<()>)>;

/// Writes verified chunks to the partial file on the blocking pool, one write in
/// flight while the next chunk is received: two chunk buffers in all.
struct Writer {
    path: PathBuf,
    file: Option<File>,
    pending: Option<PendingWrite>,
    free: Vec<Vec<u8>>,
}

impl Writer {
    fn new(path: PathBuf, file: File, chunk_bytes: usize) -> Self {
        Writer { path, file: Some(file), pending: None, free: vec![vec![0u8; chunk_bytes], vec![0u8; chunk_bytes]] }
    }

    /// A buffer to receive into: with two buffers and at most one write in flight,
    /// one is always free here.
    fn buffer(&mut self) -> Vec<u8> {
        // Invariant (above): `write` takes one buffer and `drain` returns the other first.
        self.free.pop().expect("a free chunk buffer")
    }

    /// Wait for the write in flight.
    async fn drain(&mut self) -> Result<(), FetchError> {
        if let Some(p) = self.pending.take() {
            let (file, buf, r) = match p.await {
                Ok(x) => x,
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            };
            self.file = Some(file);
            self.free.push(buf);
            r.map_err(io_err(&self.path))?;
        }
        Ok(())
    }

    async fn write(&mut self, offset: u64, buf: Vec<u8>, len: usize) -> Result<(), FetchError> {
        self.drain().await?;
        // Invariant: after a drain the file is back (it is only away while pending).
        let mut file = self.file.take().expect("the partial file");
        self.pending = Some(tokio::task::spawn_blocking(move || {
            let r = file.seek(SeekFrom::Start(offset)).and_then(|_| file.write_all(&buf[..len]));
            (file, buf, r)
        }));
        Ok(())
    }

    /// Everything written so far reaches the disk.
    async fn sync(&mut self) -> Result<(), FetchError> {
        self.drain().await?;
        // Invariant: after a drain the file is back.
        let file = self.file.take().expect("the partial file");
        let (file, r) = blocking(move || {
            let r = file.sync_data();
            (file, r)
        })
        .await;
        self.file = Some(file);
        r.map_err(io_err(&self.path))
    }

    /// Sync, then record `verified` leading chunks as held.
    async fn checkpoint(&mut self, dest: &Path, blake3: &str, verified: u64) -> Result<(), FetchError> {
        self.sync().await?;
        let (d, b) = (dest.to_owned(), blake3.to_owned());
        blocking(move || write_record(&d, &b, verified)).await
    }
}

/// Ask `holder` on `conn` for the shard and receive it into `dest`.
async fn receive(
    conn: &quinn::Connection,
    holder: NodeId,
    source: SourceHash,
    range: LayerRange,
    dest: &Path,
    mut resume: Option<(Manifest, u64)>,
    progress: &mut (dyn FnMut(&Progress) + Send),
) -> Result<Obtained, FetchError> {
    let cut = |chunk: u64| move |e: &dyn std::fmt::Display| FetchError::Cut { holder, chunk, why: e.to_string() };
    // At most two turns: a holder whose manifest differs from the partial file's
    // makes us start that file over, once.
    let (mut recv, m, from) = loop {
        let from = resume.as_ref().map_or(0, |r| r.1);
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| cut(from)(&e))?;
        let req = Request { source, layers: range, format: SHARD_FORMAT, from_chunk: from };
        write_msg(&mut send, &req).await.map_err(|e| cut(from)(&e))?;
        let _ = send.finish();
        let m = match read_msg::<Reply>(&mut recv, MAX_REPLY).await.map_err(|e| cut(from)(&e))? {
            Reply::Refused(refusal) => return Err(FetchError::Refused { holder, refusal }),
            Reply::Manifest(m) => m,
        };
        let bad = |why: String| FetchError::BadManifest { holder, why };
        m.check().map_err(bad)?;
        if m.layers != range || m.source != Some(source) {
            return Err(bad(format!("it is for layers {} of {:?}", m.layers, m.source)));
        }
        match &resume {
            Some((held, _)) if *held != m => {
                // Another build of the same shard (a holder with other code): what we
                // hold belongs to the other one. Hashes decide, not who sent it.
                tracing::warn!(%holder, "the holder's manifest differs from the partial file's; starting over");
                let _ = recv.stop(0u32.into());
                let d = dest.to_owned();
                blocking(move || clear_partial(&d)).await;
                resume = None;
            }
            _ => break (recv, m, from),
        }
    };

    let (d, mc) = (dest.to_owned(), m.clone());
    let file = blocking(move || open_part(&d, &mc, from == 0)).await?;
    let mut writer = Writer::new(part_path(dest), file, m.chunk_bytes as usize);
    let n = m.chunks.len() as u64;
    let mut stats = TransferStats { resumed_at: from, ..TransferStats::default() };
    let mut done = from;
    let mut tag = [0u8; 1];
    let result: Result<(), FetchError> = async {
        while done < n {
            let i = done as usize;
            // Invariant: i < chunks.len() and a checked manifest spans every chunk.
            let (offset, len) = m.chunk_span(i).expect("a chunk of a checked manifest");
            read_exact(&mut recv, &mut tag).await.map_err(|e| cut(done)(&e))?;
            let protocol = |why: &str| FetchError::Protocol { holder, chunk: done, why: why.to_string() };
            match (tag[0], m.chunks[i]) {
                (TAG_HOLE, Chunk::Hole) => stats.holes += 1,
                (TAG_HOLE, Chunk::Data(_)) => return Err(protocol("a hole marker for a data chunk")),
                (TAG_DATA, Chunk::Hole) => return Err(protocol("data for a hole chunk")),
                (TAG_DATA, Chunk::Data(hash)) => {
                    let mut buf = writer.buffer();
                    let r = read_exact(&mut recv, &mut buf[..len as usize]).await;
                    if let Err(e) = r {
                        writer.free.push(buf);
                        return Err(cut(done)(&e));
                    }
                    if blake3::hash(&buf[..len as usize]) != hash {
                        writer.free.push(buf);
                        return Err(FetchError::CorruptChunk { holder, chunk: done, offset, len });
                    }
                    writer.write(offset, buf, len as usize).await?;
                    stats.data_chunks += 1;
                    stats.data_bytes += len;
                }
                (TAG_ABORT, _) => {
                    let refusal: Refusal = read_msg(&mut recv, MAX_REPLY).await.map_err(|e| cut(done)(&e))?;
                    return Err(FetchError::Refused { holder, refusal });
                }
                (t, _) => return Err(protocol(&format!("unknown chunk tag {t}"))),
            }
            done += 1;
            if (done - from).is_multiple_of(SYNC_EVERY) && done < n {
                writer.checkpoint(dest, &m.blake3, done).await?;
            }
            progress(&Progress { holder, chunks_done: done, chunks: n, data_bytes: stats.data_bytes });
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        // Keep what was verified: the next try (any holder) starts after it. Not after
        // a failed write, though: `done` counts the chunk whose write failed.
        if matches!(e, FetchError::Io { .. }) {
            return Err(e);
        }
        if let Err(c) = writer.checkpoint(dest, &m.blake3, done).await {
            tracing::warn!("could not record the progress of a cut transfer: {c}");
        }
        return Err(e);
    }
    let _ = recv.stop(0u32.into());
    writer.sync().await?;
    drop(writer);

    let (d, mc) = (dest.to_owned(), m.clone());
    let whole = blocking(move || -> Result<bool, FetchError> {
        if !verify(&part_path(&d), &mc)? {
            clear_partial(&d);
            return Ok(false);
        }
        install(&part_path(&d), &d, &mc)?;
        let _ = fs::remove_file(record_path(&d));
        let _ = fs::remove_file(part_manifest_path(&d));
        Ok(true)
    })
    .await?;
    if !whole {
        return Err(FetchError::WholeFile { holder });
    }
    Ok(Obtained {
        file: ShardFile { path: dest.to_owned(), layers: range, built: true },
        manifest: m,
        origin: Origin::Holder(holder),
        stats,
    })
}
