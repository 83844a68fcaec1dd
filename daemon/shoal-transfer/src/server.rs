//! The holder's side: answer fetches on a member's connection, from the cache or by
//! cutting the shard from a full model this node holds. Memory per transfer is one
//! chunk buffer (the file is streamed from disk); transfers run at most
//! [`ServerOptions::max_transfers`] at once, more are refused as [`Refusal::Busy`]
//! (the asker tries another holder or comes back) rather than queued behind a slow one.

use crate::wire::{read_msg, write_msg, Refusal, Reply, Request, MAX_REQUEST, TAG_ABORT, TAG_DATA, TAG_HOLE};
use crate::{locks, Sources};
use shoal_gguf::shard::SHARD_FORMAT;
use shoal_gguf::{Chunk, Manifest, ShardCache, ShardError};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// How long a request for a range this node does not know to be run waits for its
/// view of the cluster to catch up before it is refused.
const CUT_WAIT: Duration = Duration::from_secs(5);
/// How often it looks again meanwhile.
const CUT_POLL: Duration = Duration::from_millis(100);

/// How a holder serves.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Transfers (and shard builds) at once; more are refused as busy.
    pub max_transfers: usize,
    /// A request must arrive within this long after its stream opens.
    pub request_timeout: Duration,
    /// Sending one chunk may take this long (an asker that stops reading holds a
    /// transfer slot no longer than this).
    pub chunk_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_transfers: 4,
            request_timeout: Duration::from_secs(10),
            chunk_timeout: Duration::from_secs(60),
        }
    }
}

/// What a holder has done since it started (for status pages and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Requests read (well-formed or not).
    pub requests: u64,
    /// Requests answered with a refusal (before or during the transfer).
    pub refused: u64,
    /// Data chunks sent.
    pub data_chunks: u64,
    /// Hole markers sent.
    pub holes: u64,
    /// Chunk bytes sent (not counting framing and QUIC).
    pub data_bytes: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    refused: AtomicU64,
    data_chunks: AtomicU64,
    holes: AtomicU64,
    data_bytes: AtomicU64,
}

/// Serves shards; cheap to clone (one shared state).
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

struct Inner {
    cache: ShardCache,
    sources: Arc<dyn Sources>,
    opts: ServerOptions,
    slots: Arc<tokio::sync::Semaphore>,
    counters: Counters,
}

/// Why one transfer ended early on the holder's side (logged; the asker got a refusal
/// or a cut stream).
#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("refused: {0}")]
    Refused(Refusal),
    #[error("stream: {0}")]
    Stream(String),
    #[error("the asker took longer than {0:?} to take a chunk")]
    Stalled(Duration),
}

impl Server {
    /// A holder serving shards from `cache`, building missing ones from the models
    /// `sources` names.
    pub fn new(cache: ShardCache, sources: Arc<dyn Sources>, opts: ServerOptions) -> Server {
        let slots = Arc::new(tokio::sync::Semaphore::new(opts.max_transfers));
        Server { inner: Arc::new(Inner { cache, sources, opts, slots, counters: Counters::default() }) }
    }

    /// What it has done so far.
    pub fn stats(&self) -> ServerStats {
        let c = &self.inner.counters;
        ServerStats {
            requests: c.requests.load(Relaxed),
            refused: c.refused.load(Relaxed),
            data_chunks: c.data_chunks.load(Relaxed),
            holes: c.holes.load(Relaxed),
            data_bytes: c.data_bytes.load(Relaxed),
        }
    }

    /// Serve every fetch on `conn` (an accepted [`shoal_net::alpn::SHARD`] connection,
    /// whose peer the handshake proved a member) until it closes. Each stream is one
    /// fetch, served in a task of its own; QUIC's stream limit bounds how many a peer
    /// can have open.
    pub async fn serve(&self, conn: quinn::Connection) {
        let peer = shoal_net::endpoint::peer_id(&conn);
        while let Ok((send, recv)) = conn.accept_bi().await {
            let this = self.clone();
            tokio::spawn(async move {
                if let Err(e) = this.answer(send, recv).await {
                    tracing::info!(peer = ?peer, "shard transfer ended: {e}");
                }
            });
        }
    }

    async fn answer(&self, mut send: quinn::SendStream, mut recv: quinn::RecvStream) -> Result<(), ServeError> {
        let c = &self.inner.counters;
        c.requests.fetch_add(1, Relaxed);
        let result = self.transfer(&mut send, &mut recv).await;
        if let Err(ServeError::Refused(r)) = &result {
            c.refused.fetch_add(1, Relaxed);
            let _ = write_msg(&mut send, &Reply::Refused(r.clone())).await;
            let _ = send.finish();
        }
        result
    }

    /// Read the request, send the manifest and the chunks. A refusal before the
    /// manifest is returned for [`Server::answer`] to send; one after it goes inline.
    async fn transfer(&self, send: &mut quinn::SendStream, recv: &mut quinn::RecvStream) -> Result<(), ServeError> {
        let opts = &self.inner.opts;
        let req: Request = match tokio::time::timeout(opts.request_timeout, read_msg(recv, MAX_REQUEST)).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return Err(ServeError::Refused(Refusal::BadRequest { why: e.to_string() })),
            Err(_) => {
                let why = format!("no request within {:?}", opts.request_timeout);
                return Err(ServeError::Refused(Refusal::BadRequest { why }));
            }
        };
        if req.format != SHARD_FORMAT {
            return Err(ServeError::Refused(Refusal::Format { asked: req.format, ours: SHARD_FORMAT }));
        }
        let Ok(_slot) = self.inner.slots.clone().try_acquire_owned() else {
            return Err(ServeError::Refused(Refusal::Busy { max: opts.max_transfers }));
        };
        let manifest = self.manifest_for(&req).await.map_err(ServeError::Refused)?;
        let chunks = manifest.chunks.len() as u64;
        if req.from_chunk > chunks {
            return Err(ServeError::Refused(Refusal::BadChunk { from_chunk: req.from_chunk, chunks }));
        }
        let path = self.inner.cache.content_path(&req.source, req.layers);
        write_msg(send, &Reply::Manifest(manifest.clone())).await.map_err(|e| ServeError::Stream(e.to_string()))?;
        match self.send_chunks(send, &manifest, path, req.from_chunk).await {
            Err(ServeError::Refused(r)) => {
                // Part way: the asker keeps what it verified and tries elsewhere.
                self.inner.counters.refused.fetch_add(1, Relaxed);
                let mut msg = vec![TAG_ABORT];
                // Invariant: a refusal always serialises (strings and integers only).
                let json = serde_json::to_vec(&r).expect("a refusal serialises");
                msg.extend_from_slice(&(json.len() as u32).to_be_bytes());
                msg.extend_from_slice(&json);
                send.write_all(&msg).await.map_err(|e| ServeError::Stream(e.to_string()))?;
                let _ = send.finish();
                Err(ServeError::Refused(r))
            }
            Err(e) => {
                let _ = send.reset(1u32.into());
                Err(e)
            }
            Ok(()) => {
                let _ = send.finish();
                Ok(())
            }
        }
    }

    /// The manifest of the shard asked for: from the cache, else built from a model
    /// this node holds (one build per shard at a time).
    async fn manifest_for(&self, req: &Request) -> Result<Manifest, Refusal> {
        let failed = |e: &dyn std::fmt::Display| Refusal::Failed { why: e.to_string() };
        let (source, layers) = (req.source, req.layers);
        let cache = self.inner.cache.clone();
        let cached = {
            let cache = cache.clone();
            tokio::task::spawn_blocking(move || cache.content_manifest(&source, layers))
                .await
                .map_err(|e| failed(&e))?
        };
        if let Some(m) = cached {
            return Ok(m);
        }
        let model = self.inner.sources.model_path(&source).ok_or(Refusal::NotHere)?;
        // A range the cluster runs, or none: the asker may have seen a placement this
        // node has not applied yet, so it is given a few seconds to.
        let mut waited = Duration::ZERO;
        while !self.inner.sources.cuts(&source, layers) {
            if waited >= CUT_WAIT {
                let why = "not a range this cluster runs (a placed stage's, the measurement's or the whole model)";
                return Err(Refusal::BadRange { why: why.into() });
            }
            tokio::time::sleep(CUT_POLL).await;
            waited += CUT_POLL;
        }
        let _building = locks::lock(&cache.content_path(&source, layers)).await;
        let built = tokio::task::spawn_blocking(move || cache.build_for(&source, &model, layers))
            .await
            .map_err(|e| failed(&e))?;
        match built {
            Ok((file, m)) => {
                if file.built {
                    tracing::info!(path = %file.path.display(), "built a shard to serve");
                }
                Ok(m)
            }
            Err(ShardError::BadRange { why, .. }) => Err(Refusal::BadRange { why }),
            Err(e) => Err(failed(&e)),
        }
    }

    /// Stream chunks `from..` of the shard at `path`: one chunk buffer, read from disk
    /// on the blocking pool while nothing else is in flight for this transfer.
    async fn send_chunks(
        &self,
        send: &mut quinn::SendStream,
        m: &Manifest,
        path: PathBuf,
        from: u64,
    ) -> Result<(), ServeError> {
        let c = &self.inner.counters;
        let chunk_timeout = self.inner.opts.chunk_timeout;
        let failed = |e: &dyn std::fmt::Display| ServeError::Refused(Refusal::Failed { why: e.to_string() });
        let mut file = Some(File::open(&path).map_err(|e| failed(&format!("{}: {e}", path.display())))?);
        let mut buf = Some(vec![0u8; m.chunk_bytes as usize]);
        for i in from as usize..m.chunks.len() {
            // Invariant: i < chunks.len(), and a checked manifest spans its chunks.
            let (offset, len) = m.chunk_span(i).ok_or_else(|| failed(&format!("chunk {i} outside the shard")))?;
            if m.chunks[i] == Chunk::Hole {
                timed(chunk_timeout, send.write_all(&[TAG_HOLE])).await?;
                c.holes.fetch_add(1, Relaxed);
                continue;
            }
            // Both are Some at the top of every turn: taken here, put back below.
            let (mut f, mut b) = (file.take().expect("file"), buf.take().expect("buffer"));
            let (f, b, read) = tokio::task::spawn_blocking(move || {
                let r = f.seek(SeekFrom::Start(offset)).and_then(|_| f.read_exact(&mut b[..len as usize]));
                (f, b, r)
            })
            .await
            .map_err(|e| failed(&e))?;
            read.map_err(|e| failed(&format!("{}: chunk {i}: {e}", path.display())))?;
            timed(chunk_timeout, async {
                send.write_all(&[TAG_DATA]).await?;
                send.write_all(&b[..len as usize]).await
            })
            .await?;
            c.data_chunks.fetch_add(1, Relaxed);
            c.data_bytes.fetch_add(len, Relaxed);
            (file, buf) = (Some(f), Some(b));
        }
        Ok(())
    }
}

async fn timed<T>(
    limit: Duration,
    fut: impl std::future::Future<Output = Result<T, quinn::WriteError>>,
) -> Result<T, ServeError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r.map_err(|e| ServeError::Stream(e.to_string())),
        Err(_) => Err(ServeError::Stalled(limit)),
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("cache", &self.inner.cache.dir()).field("stats", &self.stats()).finish()
    }
}
