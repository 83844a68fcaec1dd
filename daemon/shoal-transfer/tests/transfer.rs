//! Shard transfer over real QUIC on 127.0.0.1 between members that trust each other,
//! with the real test model: what travels, cuts and resumes, corrupted holders,
//! restarts, strangers and malformed requests.

mod common;
use common::*;
use shoal_gguf::{Chunk, Manifest, CHUNK_BYTES};
use shoal_net::{alpn, NodeId};
use shoal_transfer::wire::{self, Refusal, Reply, Request};
use shoal_transfer::{fetch, fetch_from_any, obtain, FetchError, Origin, ServerOptions};
use shoal_types::LayerRange;
use std::collections::HashMap;
use std::fs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const MIDDLE: LayerRange = LayerRange { start: 10, end: 20 };

/// A holder (A) with the full model and a receiver (B) with nothing, trusting each other.
fn holder_and_receiver() -> (Member, Member) {
    let ids = identities(2);
    let all: Vec<NodeId> = ids.iter().map(|i| i.id()).collect();
    let a = member(ids[0].clone(), &all, holding_model());
    let b = member(ids[1].clone(), &all, HashMap::new());
    (a, b)
}

fn data_chunks_from(m: &Manifest, from: u64) -> u64 {
    m.chunks[from as usize..].iter().filter(|c| **c != Chunk::Hole).count() as u64
}

#[cfg(unix)]
fn on_disk(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).unwrap().blocks() * 512
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn middle_stage_shard_travels_without_its_holes() {
    let (a, b) = holder_and_receiver();
    let mut last = None;
    let got =
        fetch(&b.node, a.id, a.holder().addr, model_hash(), MIDDLE, &b.cache, &mut |p: &shoal_transfer::Progress| {
            last = Some(*p)
        })
        .await
        .unwrap();
    assert_eq!(got.origin, Origin::Holder(a.id));
    let m = &got.manifest;
    assert_eq!(last.map(|p| (p.chunks_done, p.chunks)), Some((m.chunks.len() as u64, m.chunks.len() as u64)));

    // What crossed: exactly the manifest's data chunks, which are the shard's real
    // bytes (everything but the embedding hole) rounded out to whole chunks.
    let (_, meta) = shoal_gguf::open_model(&model()).unwrap();
    let model_bytes = fs::metadata(model()).unwrap().len();
    let real = m.bytes - meta.embd_bytes;
    let s = got.stats;
    assert_eq!(s.resumed_at, 0);
    assert_eq!(s.data_bytes, m.data_bytes());
    assert_eq!(s.data_chunks + s.holes, m.chunks.len() as u64);
    assert!(s.holes > 0, "the embedding should travel as hole markers");
    assert!(
        real <= s.data_bytes && s.data_bytes <= real + 2 * CHUNK_BYTES,
        "sent {} chunk bytes for {real} real bytes",
        s.data_bytes
    );
    // On the wire: the chunks plus the manifest, framing, QUIC and TLS; far below the model.
    assert!(s.wire_bytes >= s.data_bytes, "{s:?}");
    assert!(s.wire_bytes <= s.data_bytes + s.data_bytes / 20 + (1 << 20), "{s:?}");
    assert!(s.wire_bytes < model_bytes * 3 / 4, "{} wire bytes for a {model_bytes}-byte model", s.wire_bytes);
    let served = a.server.stats();
    assert_eq!((served.data_chunks, served.holes, served.data_bytes), (s.data_chunks, s.holes, s.data_bytes));

    // Bit-identical to the shard built locally, and sparse where the holes are.
    let local = local_shard(b.dir.path(), MIDDLE);
    assert_eq!(fs::read(&got.file.path).unwrap(), local);
    #[cfg(unix)]
    assert!(
        on_disk(&got.file.path) + meta.embd_bytes / 2 < m.bytes,
        "received shard of {} bytes uses {} on disk",
        m.bytes,
        on_disk(&got.file.path)
    );
    // The cache now holds it, verified, where a stage would look.
    let (hit, hm) = b.cache.cached(&model_hash(), MIDDLE).unwrap().expect("cached after the transfer");
    assert_eq!((hit.path, &hm), (got.file.path.clone(), m));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cut_mid_transfer_resumes_at_the_first_unverified_chunk() {
    let ids = identities(3);
    let all: Vec<NodeId> = ids.iter().map(|i| i.id()).collect();
    let a = member(ids[0].clone(), &all, holding_model());
    let b = member(ids[1].clone(), &all, HashMap::new());
    const CUT_AT: u64 = 20;

    // The receiver's endpoint closes after CUT_AT chunks (its process going away).
    let node = b.node.clone();
    let first = fetch(&b.node, a.id, a.holder().addr, model_hash(), MIDDLE, &b.cache, &mut |p| {
        if p.chunks_done == CUT_AT {
            node.close();
        }
    })
    .await;
    // Chunks already buffered may still be read before the close takes effect.
    let cut = match &first {
        Err(FetchError::Cut { holder, chunk, .. }) if *holder == a.id && *chunk >= CUT_AT => *chunk,
        other => panic!("expected a cut at chunk {CUT_AT} or after, got {other:?}"),
    };
    assert!(b.cache.cached(&model_hash(), MIDDLE).unwrap().is_none());
    let sent_before = a.server.stats();

    // The receiver comes back (same key, new endpoint, same cache directory).
    let b2 = member(ids[1].clone(), &all, HashMap::new());
    let got = fetch(&b2.node, a.id, a.holder().addr, model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap();
    let m = &got.manifest;
    // It asked from the first chunk it did not hold (holes after the cut read as the
    // zeros they are, so they count as held).
    let first_missing = (cut..m.chunks.len() as u64).find(|&i| m.chunks[i as usize] != Chunk::Hole).unwrap();
    assert_eq!(got.stats.resumed_at, first_missing);
    assert_eq!(got.stats.data_chunks, data_chunks_from(m, first_missing));
    // The holder sent only those this time.
    let sent = a.server.stats();
    assert_eq!(sent.data_chunks - sent_before.data_chunks, got.stats.data_chunks);
    assert!(got.stats.data_bytes < m.data_bytes());
    assert_eq!(fs::read(&got.file.path).unwrap(), local_shard(b.dir.path(), MIDDLE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_dropped_mid_transfer_resumes_from_what_reached_the_disk() {
    let (a, b) = holder_and_receiver();
    // The fetch is dropped mid-way (as a killed process stops: no error path runs).
    const STOP_AFTER: u64 = 40;
    let stop = Arc::new(tokio::sync::Notify::new());
    let seen = Arc::new(AtomicBool::new(false));
    let (s, st) = (stop.clone(), seen.clone());
    let mut on_progress = move |p: &shoal_transfer::Progress| {
        if p.chunks_done >= STOP_AFTER && !st.swap(true, Ordering::SeqCst) {
            s.notify_one();
        }
    };
    tokio::select! {
        r = fetch(&b.node, a.id, a.holder().addr, model_hash(), MIDDLE, &b.cache, &mut on_progress) => {
            panic!("the fetch finished before it was stopped: {r:?}")
        }
        _ = stop.notified() => {}
    }

    let got = fetch(&b.node, a.id, a.holder().addr, model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap();
    let m = &got.manifest;
    // At least what the last sync recorded is kept; chunks written after it that
    // verify are kept too; the rest is asked for again, once.
    let recorded = STOP_AFTER / shoal_transfer::SYNC_EVERY * shoal_transfer::SYNC_EVERY;
    assert!(got.stats.resumed_at >= recorded, "resumed at {} (recorded {recorded})", got.stats.resumed_at);
    assert!(got.stats.resumed_at < m.chunks.len() as u64);
    assert_eq!(got.stats.data_chunks, data_chunks_from(m, got.stats.resumed_at));
    assert_eq!(fs::read(&got.file.path).unwrap(), local_shard(b.dir.path(), MIDDLE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_chunk_on_the_holders_disk_is_caught_and_the_good_holder_used() {
    let ids = identities(3);
    let all: Vec<NodeId> = ids.iter().map(|i| i.id()).collect();
    // A holds the shard in its cache (and not the model); C holds the model.
    let a = member(ids[0].clone(), &all, HashMap::new());
    let b = member(ids[1].clone(), &all, HashMap::new());
    let c = member(ids[2].clone(), &all, holding_model());
    let (shard, m) = a.cache.build_for(&model_hash(), &model(), MIDDLE).unwrap();
    // One byte of a data chunk past the first checkpoint rots on A's disk after the build.
    let bad = (shoal_transfer::SYNC_EVERY as usize + 3..m.chunks.len())
        .find(|&i| m.chunks[i] != Chunk::Hole)
        .expect("a data chunk");
    let (offset, len) = m.chunk_span(bad).unwrap();
    let mut bytes = fs::read(&shard.path).unwrap();
    bytes[(offset + len / 2) as usize] ^= 0x10;
    fs::write(&shard.path, &bytes).unwrap();

    // From A alone: refused, naming the chunk and the holder; nothing cached.
    let e = fetch_from_any(&b.node, &[a.holder()], model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap_err();
    let FetchError::NoGoodHolder { tried, .. } = &e else { panic!("expected NoGoodHolder, got {e:?}") };
    match tried.as_slice() {
        [FetchError::CorruptChunk { holder, chunk, .. }] => assert_eq!((*holder, *chunk), (a.id, bad as u64)),
        other => panic!("expected one corrupt-chunk error, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(&format!("chunk {bad}")) && msg.contains(&a.id.to_string()), "{msg}");
    assert!(b.cache.cached(&model_hash(), MIDDLE).unwrap().is_none());

    // With A then C: A fails at the bad chunk again, C supplies the rest.
    let got =
        fetch_from_any(&b.node, &[a.holder(), c.holder()], model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap();
    assert_eq!(got.origin, Origin::Holder(c.id));
    // C was asked only from the corrupted chunk on: what A sent before it was good.
    assert_eq!(got.stats.resumed_at, bad as u64);
    assert_eq!(fs::read(&got.file.path).unwrap(), local_shard(b.dir.path(), MIDDLE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_receiver_with_a_complete_cache_moves_no_bytes() {
    let (a, b) = holder_and_receiver();
    let first = fetch(&b.node, a.id, a.holder().addr, model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap();
    assert_eq!(first.origin, Origin::Holder(a.id));
    let served = a.server.stats();

    // A new process: new endpoint, same cache directory.
    b.node.close();
    let ids = identities(1);
    let b2 = member(ids[0].clone(), &[a.id], HashMap::new());
    let again = fetch(&b2.node, a.id, a.holder().addr, model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap();
    assert_eq!(again.origin, Origin::Cache);
    assert_eq!(again.stats, shoal_transfer::TransferStats::default());
    assert_eq!(again.file.path, first.file.path);
    assert_eq!(a.server.stats(), served, "the holder was not even asked");
    // obtain says the same, with no holder at all.
    let o = obtain(&b2.node, &HashMap::new(), &[], model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap();
    assert_eq!(o.origin, Origin::Cache);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn obtain_builds_locally_when_the_model_is_here_and_refuses_without_holders() {
    let (a, b) = holder_and_receiver();
    let o =
        obtain(&a.node, &holding_model(), &[b.holder()], model_hash(), MIDDLE, &a.cache, &mut quiet()).await.unwrap();
    assert_eq!(o.origin, Origin::Built);
    assert_eq!(o.stats, shoal_transfer::TransferStats::default());
    assert_eq!(b.server.stats().requests, 0, "a node with the model asks nobody");
    assert_eq!(fs::read(&o.file.path).unwrap(), local_shard(a.dir.path(), MIDDLE));

    // Neither the model nor a holder: a clear refusal.
    let e = obtain(&b.node, &HashMap::new(), &[], model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap_err();
    assert!(e.to_string().contains("no holder is known"), "{e}");
    // A holder that has neither the shard nor the model: NotHere, naming it.
    let empty = tempfile::tempdir().unwrap();
    let cache = shoal_gguf::ShardCache::new(empty.path());
    let e = fetch_from_any(&a.node, &[b.holder()], model_hash(), MIDDLE, &cache, &mut quiet()).await.unwrap_err();
    assert!(e.to_string().contains(&b.id.to_string()), "{e}");
    match &e {
        FetchError::NoGoodHolder { tried, .. } => assert!(
            matches!(tried.as_slice(), [FetchError::Refused { holder, refusal: Refusal::NotHere }] if *holder == b.id),
            "{e}"
        ),
        other => panic!("expected NoGoodHolder, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_key_is_refused() {
    let ids = identities(2);
    let a = member(ids[0].clone(), &[ids[0].id()], holding_model());
    // The stranger trusts A, but A does not trust it.
    let stranger = member(ids[1].clone(), &[a.id], HashMap::new());
    let e = fetch(&stranger.node, a.id, a.holder().addr, model_hash(), MIDDLE, &stranger.cache, &mut quiet())
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::Connect { .. } | FetchError::Cut { .. }), "{e:?}");
    assert_eq!(a.server.stats().requests, 0, "no request of a stranger reached the server");
    assert!(stranger.cache.cached(&model_hash(), MIDDLE).unwrap().is_none());
}

/// Send `raw` as the whole request stream and read the reply.
async fn raw_request(conn: &quinn::Connection, raw: &[u8]) -> Reply {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(raw).await.unwrap();
    send.finish().unwrap();
    wire::read_msg(&mut recv, wire::MAX_REPLY).await.unwrap()
}

fn framed(req: &Request) -> Vec<u8> {
    let json = serde_json::to_vec(req).unwrap();
    let mut out = (json.len() as u32).to_be_bytes().to_vec();
    out.extend(json);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_an_error_and_the_server_keeps_serving() {
    let (a, b) = holder_and_receiver();
    let conn = b.node.connect(a.holder().addr, a.id, alpn::SHARD).await.unwrap();
    let good = Request { source: model_hash(), layers: MIDDLE, format: shoal_gguf::shard::SHARD_FORMAT, from_chunk: 0 };

    let refused = |r: Reply| match r {
        Reply::Refused(r) => r,
        Reply::Manifest(_) => panic!("a manifest for a bad request"),
    };
    // An announced length over the bound: refused without reading it.
    let r = refused(raw_request(&conn, &u32::MAX.to_be_bytes()).await);
    assert!(matches!(&r, Refusal::BadRequest { why } if why.contains("over the limit")), "{r}");
    // Not JSON; cut short; an unknown field.
    for raw in [b"\x00\x00\x00\x05hello".to_vec(), b"\x00\x00\x00\x40{}".to_vec(), {
        let mut j = serde_json::to_value(&good).unwrap();
        j["extra"] = 1.into();
        let j = serde_json::to_vec(&j).unwrap();
        [(j.len() as u32).to_be_bytes().to_vec(), j].concat()
    }] {
        let r = refused(raw_request(&conn, &raw).await);
        assert!(matches!(r, Refusal::BadRequest { .. }), "{r}");
    }
    // Well-formed, but not servable.
    let cases = [
        (Request { source: shoal_gguf::SourceHash([9; 32]), ..good.clone() }, "NotHere"),
        (Request { layers: LayerRange::new(10, 99), ..good.clone() }, "BadRange"),
        (Request { format: 999, ..good.clone() }, "Format"),
        (Request { from_chunk: u64::MAX, ..good.clone() }, "BadChunk"),
    ];
    for (req, want) in &cases {
        let r = refused(raw_request(&conn, &framed(req)).await);
        assert!(format!("{r:?}").starts_with(want), "{want}: got {r:?}");
    }
    assert_eq!(a.server.stats().refused, 8);

    // The same connection still gets a shard.
    let got = fetch(&b.node, a.id, a.holder().addr, model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap();
    assert_eq!(got.origin, Origin::Holder(a.id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_at_its_transfer_cap_says_busy() {
    let ids = identities(2);
    let all: Vec<NodeId> = ids.iter().map(|i| i.id()).collect();
    let a =
        member_with(ids[0].clone(), &all, holding_model(), ServerOptions { max_transfers: 0, ..Default::default() });
    let b = member(ids[1].clone(), &all, HashMap::new());
    let e = fetch(&b.node, a.id, a.holder().addr, model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap_err();
    assert!(matches!(e, FetchError::Refused { refusal: Refusal::Busy { max: 0 }, .. }), "{e:?}");
}

/// Sources that hold the model but cut only `MIDDLE` for others (as a node cuts only
/// the ranges its cluster runs).
struct OnlyMiddle(HashMap<shoal_transfer::SourceHash, std::path::PathBuf>);

impl shoal_transfer::Sources for OnlyMiddle {
    fn model_path(&self, source: &shoal_transfer::SourceHash) -> Option<std::path::PathBuf> {
        self.0.model_path(source)
    }
    fn cuts(&self, _: &shoal_transfer::SourceHash, layers: LayerRange) -> bool {
        layers == MIDDLE
    }
}

/// Security review F11: a member asking a holder for ranges the cluster does not run
/// (every `a..b` of a large model would fill the holder's disk) is refused, after the
/// holder gave its view a few seconds to catch up, and nothing is cut; a range it runs
/// travels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cuts_only_the_ranges_its_cluster_runs() {
    let ids = identities(2);
    let all: Vec<NodeId> = ids.iter().map(|i| i.id()).collect();
    let a = member_serving(ids[0].clone(), &all, Arc::new(OnlyMiddle(holding_model())), ServerOptions::default());
    let b = member(ids[1].clone(), &all, HashMap::new());
    let odd = LayerRange { start: 3, end: 17 };
    let e = fetch_from_any(&b.node, &[a.holder()], model_hash(), odd, &b.cache, &mut quiet()).await.unwrap_err();
    assert!(e.to_string().contains("not a range this cluster runs"), "{e}");
    assert!(a.cache.content_manifest(&model_hash(), odd).is_none(), "the holder cut the shard anyway");
    let got = fetch_from_any(&b.node, &[a.holder()], model_hash(), MIDDLE, &b.cache, &mut quiet()).await.unwrap();
    assert_eq!(fs::read(&got.file.path).unwrap(), local_shard(a.dir.path(), MIDDLE));
}
