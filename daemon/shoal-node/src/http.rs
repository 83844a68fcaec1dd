//! The node's side of the HTTP API: [`shoal_api::Backend`] over the cluster state (the
//! catalog and placements this node sees), a vocabulary read from a file this node
//! holds, and generation forwarded to the model's coordinator wherever it runs.

use crate::api::{ApiError, CopyState, ErrorKind};
use crate::models;
use crate::runtime::{self, Runtime};
use shoal_api::{Backend, Failure, FailureKind, ModelInfo, ModelState, Sampled, TextModel};
use shoal_pipeline::{GenerateRequest, Report};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// The name of the file in the data directory that holds the API's bound address
/// (the CLI and tests read it; the port may be chosen by the system).
pub const HTTP_FILE: &str = "http";

/// Positions per session of a model loaded by a first request.
pub const DEFAULT_CONTEXT: u32 = 4096;

/// How long a request that came before membership published its first view waits
/// for it (a node's start takes well under a second).
const STATE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The API's view of this node.
pub struct NodeBackend {
    /// Placement, stages, generation.
    pub(crate) rt: Arc<Runtime>,
    /// Vocabularies loaded so far, by content hash (a few MB each; models are few).
    pub(crate) texts: Mutex<HashMap<String, Arc<dyn TextModel>>>,
    /// The API's counters.
    pub(crate) metrics: shoal_api::Metrics,
    /// Where `/api/pull` downloads go (`<data dir>/models`, as `shoal models add URL`).
    pub(crate) downloads: PathBuf,
    /// Where `/api/pull` may download from (`Access::private_downloads`).
    pub(crate) pull_limits: shoal_catalog::Limits,
    /// Held while a pull runs: one at a time (each may take the disk's free space).
    pub(crate) pulling: tokio::sync::Mutex<()>,
}

impl Backend for NodeBackend {
    async fn models(&self) -> Vec<ModelInfo> {
        // A node that has just (re)started serves HTTP a moment before membership has
        // read its stored cluster state: answering then would say "catalog empty" (a
        // 404) to a client whose model exists.
        let mut rx = self.rt.membership.view();
        let _ = tokio::time::timeout(STATE_WAIT, rx.wait_for(|v| v.listening.is_some())).await;
        let view = rx.borrow().clone();
        let mut placements = runtime::placements(&view);
        let mut out = Vec::new();
        for entry in models::entries(&view) {
            let placement = placements.remove(&entry.content_hash);
            let (state, context) = match placement {
                None => (ModelState::Available, None),
                Some(p) => match &p.error {
                    Some(e) => (ModelState::Unplaced(e.clone()), Some(p.context)),
                    None if runtime::stages_ready(&self.rt, &view, &p).await => (ModelState::Ready, Some(p.context)),
                    None => (ModelState::Starting, Some(p.context)),
                },
            };
            out.push(ModelInfo { entry, state, context });
        }
        out.sort_by(|a, b| a.entry.name.cmp(&b.entry.name));
        out
    }

    async fn load(&self, model: &str) -> Result<(), Failure> {
        let view = self.rt.membership.view().borrow().clone();
        let catalog = models::entries(&view);
        let entry = models::find(&catalog, model).map_err(failure)?;
        // The default of `shoal models load`, within what the model was trained for.
        let context = DEFAULT_CONTEXT.min(entry.context_length.max(16));
        runtime::load(&self.rt, &entry.content_hash.clone(), context, 1, &[]).await.map(drop).map_err(failure)
    }

    async fn unload(&self, model: &str) -> Result<(), Failure> {
        runtime::unload(&self.rt, model).await.map(drop).map_err(failure)
    }

    async fn remove(&self, model: &str) -> Result<(), Failure> {
        let mut view_rx = self.rt.membership.view();
        let hash = models::find(&models::entries(&view_rx.borrow()), model).map_err(failure)?.content_hash.clone();
        let load_key = format!("{}{hash}", shoal_types::LoadSpec::KEY_PREFIX);
        let loaded =
            |v: &shoal_membership::node::View| v.state.as_ref().is_some_and(|s| s.entries.contains_key(&load_key));
        if loaded(&view_rx.borrow()) {
            runtime::unload(&self.rt, &hash).await.map_err(failure)?;
            // The catalog refuses to drop a loaded model: wait for the unload to reach
            // this node's view (a commit is seen within a beat).
            let seen = tokio::time::timeout(std::time::Duration::from_secs(10), async {
                while loaded(&view_rx.borrow_and_update()) {
                    if view_rx.changed().await.is_err() {
                        break;
                    }
                }
            });
            if seen.await.is_err() {
                return Err(Failure::new(FailureKind::Unavailable, "the unload was not confirmed within 10 s"));
            }
        }
        models::remove(&self.rt.membership, &hash).await.map(drop).map_err(failure)
    }

    async fn pull(
        &self,
        source: &str,
        progress: mpsc::UnboundedSender<shoal_api::PullProgress>,
    ) -> Result<String, Failure> {
        let Ok(_one) = self.pulling.try_lock() else {
            return Err(Failure::new(FailureKind::Busy, "a pull runs on this node; try again when it is done"));
        };
        let (url, dest, limits) = (source.to_string(), self.downloads.clone(), self.pull_limits);
        let fetched = tokio::task::spawn_blocking(move || {
            let report = &mut |p: shoal_catalog::Progress| {
                let _ = progress.send(shoal_api::PullProgress { completed: p.done, total: p.total });
            };
            shoal_catalog::download_within(&url, &dest, report, limits)
        })
        .await
        .map_err(|e| Failure::new(FailureKind::Internal, e.to_string()))?;
        let path = match fetched {
            Ok(d) => d.path,
            // Pulled before: the file is there whole; adding it again checks it.
            Err(shoal_catalog::DownloadError::Exists(path)) => path,
            Err(e) => return Err(Failure::bad(format!("{source}: {e}"))),
        };
        let entry =
            models::add(self.rt.me, &self.rt.membership, &path.display().to_string(), None).await.map_err(failure)?;
        Ok(entry.name)
    }

    async fn text(&self, model: &str) -> Result<Arc<dyn TextModel>, Failure> {
        let view = self.rt.membership.view().borrow().clone();
        let catalog = models::entries(&view);
        let entry = models::find(&catalog, model).map_err(failure)?.clone();
        if let Some(t) = lock(&self.texts).get(&entry.content_hash) {
            return Ok(t.clone());
        }
        let Some(engine) = self.rt.engine.clone() else {
            return Err(Failure::new(FailureKind::Unavailable, "this node runs no engine, so it reads no vocabulary"));
        };
        let file = match self.vocab_file(&entry) {
            Some(f) => f,
            None => self.fetch_header(&entry).await?,
        };
        let text = tokio::task::spawn_blocking(move || engine.text(&file))
            .await
            .map_err(|e| Failure::new(FailureKind::Internal, e.to_string()))?
            .map_err(|e| Failure::new(FailureKind::Internal, format!("the vocabulary of {}: {e}", entry.name)))?;
        lock(&self.texts).insert(entry.content_hash.clone(), text.clone());
        Ok(text)
    }

    fn metrics(&self) -> &shoal_api::Metrics {
        &self.metrics
    }

    async fn node_metrics(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let stage = crate::runtime::stage_report(&self.rt);
        out += "# HELP shoal_stage_memory_bytes The stage this node runs: memory predicted by the planner, held once loaded (llama.cpp's buffers), and resident (this process's RSS growth since the stage loaded).\n";
        out += "# TYPE shoal_stage_memory_bytes gauge\n";
        if let Some(st) = &stage {
            let labels = format!("model=\"{}\",layers=\"{}\"", &st.model[..st.model.len().min(12)], st.layers);
            let _ = writeln!(out, "shoal_stage_memory_bytes{{{labels},kind=\"predicted\"}} {}", st.predicted_bytes);
            if let Some(b) = st.loaded_bytes {
                let _ = writeln!(out, "shoal_stage_memory_bytes{{{labels},kind=\"loaded\"}} {b}");
            }
            if let Some(b) = st.resident_bytes {
                let _ = writeln!(out, "shoal_stage_memory_bytes{{{labels},kind=\"resident\"}} {b}");
            }
            let running = u8::from(st.state == crate::api::StageState::Running);
            let _ = writeln!(out, "# TYPE shoal_stage_running gauge\nshoal_stage_running{{{labels}}} {running}");
            // Sessions the stage holds and (on a coordinator) generations queued, as its
            // stage service tells them.
            if running == 1 {
                let view = self.rt.membership.view().borrow().clone();
                let within = std::time::Duration::from_secs(1);
                if let Some(ns) = runtime::stage_status(&self.rt, &view, self.rt.me, st.layers, within).await {
                    let _ = writeln!(out, "# HELP shoal_stage_sessions Sessions (generations) the stage holds now.");
                    let _ = writeln!(
                        out,
                        "# TYPE shoal_stage_sessions gauge\nshoal_stage_sessions{{{labels}}} {}",
                        ns.sessions
                    );
                    let _ = writeln!(out, "# HELP shoal_stage_queued Generations waiting for a session (coordinator).");
                    let _ =
                        writeln!(out, "# TYPE shoal_stage_queued gauge\nshoal_stage_queued{{{labels}}} {}", ns.waiting);
                }
            }
        }
        let view = self.rt.membership.view().borrow().clone();
        let placements = runtime::placements(&view);
        let _ =
            writeln!(out, "# HELP shoal_placement_generation Times each loaded model was placed anew (re-placements).");
        let _ = writeln!(out, "# TYPE shoal_placement_generation gauge");
        for (hash, p) in &placements {
            let _ = writeln!(
                out,
                "shoal_placement_generation{{model=\"{}\"}} {}",
                &hash[..hash.len().min(12)],
                p.generation
            );
        }
        let _ = writeln!(out, "# TYPE shoal_members_alive gauge\nshoal_members_alive {}", view.alive.len());
        out
    }

    fn key_scope(&self, key: &str) -> Option<shoal_types::KeyScope> {
        crate::keys::check(&self.rt.membership.view().borrow(), key)
    }

    fn open(&self) -> bool {
        crate::admin::api_open(&self.rt.membership.view().borrow())
    }

    fn speculation(&self) -> Option<shoal_types::SpecSettings> {
        self.rt.speculation
    }

    fn fit_speculation(&self, model: &str, mut settings: shoal_types::SpecSettings) -> shoal_types::SpecSettings {
        let view = self.rt.membership.view().borrow().clone();
        let catalog = models::entries(&view);
        let Ok(entry) = models::find(&catalog, model) else { return settings };
        let placement = runtime::placements(&view).remove(&entry.content_hash);
        if let Some(cost) =
            placement.and_then(|p| shoal_types::speculative::step_cost_for(p.predicted_tok_s, p.predicted_compute_ms))
        {
            settings.step_cost = cost;
        }
        settings
    }

    async fn generate(
        &self,
        model: &str,
        request: GenerateRequest,
        tokens: mpsc::UnboundedSender<Sampled>,
    ) -> Result<Report, Failure> {
        runtime::generate(&self.rt, model, &request, |t, lp| {
            let _ = tokens.send((t, lp));
        })
        .await
        .map_err(failure)
    }
}

impl NodeBackend {
    /// A file on this node holding `entry`'s vocabulary: its own copy (when unchanged
    /// since it was added: a changed file is never read), else a shard of it (every
    /// shard keeps the whole metadata).
    fn vocab_file(&self, entry: &shoal_types::CatalogEntry) -> Option<PathBuf> {
        if let Some(h) = entry.holders.get(&self.rt.me) {
            if models::copy_state(h) == CopyState::Unchanged {
                return Some(PathBuf::from(&h.path));
            }
        }
        let dir = self.rt.cache.dir().join(format!("blake3-{}", entry.content_hash));
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "gguf") && Path::new(p).is_file())
    }
}

/// Whether `header` (fetched from a member) is the one the node that added `entry`
/// read: its hash against the catalog's (security review F8: a member could otherwise
/// hand out another vocabulary or chat template). An entry from before headers were
/// hashed has none to check against.
fn header_matches(entry: &shoal_types::CatalogEntry, header: &[u8]) -> Result<(), String> {
    match &entry.header_hash {
        Some(want) if blake3::hash(header).to_hex().as_str() != want.as_str() => {
            Err("its header is not the one the catalog names (the member served other bytes)".into())
        }
        _ => Ok(()),
    }
}

impl NodeBackend {
    /// Build a vocabulary-only file of `entry` from its header, fetched from a member
    /// that holds the model: the header's bytes, then a hole to the model's full size
    /// (llama.cpp checks that every tensor lies inside the file, and reads none of them
    /// when it loads only the vocabulary). Sparse: a few MB on disk.
    async fn fetch_header(&self, entry: &shoal_types::CatalogEntry) -> Result<PathBuf, Failure> {
        let unavailable =
            |why: String| Failure::new(FailureKind::Unavailable, format!("the vocabulary of {}: {why}", entry.name));
        let view = self.rt.membership.view().borrow().clone();
        let dir = self.rt.cache.dir().join(format!("blake3-{}", entry.content_hash));
        let dest = dir.join(VOCAB_FILE);
        let mut last = "no member that holds it is up".to_string();
        for holder in entry.holders.keys().filter(|h| **h != self.rt.me && view.alive.contains(h)) {
            let Some(addr) = view.addrs.get(holder).copied() else { continue };
            match self.header_from(*holder, addr, entry).await {
                Ok((bytes, file_size)) => {
                    let part = dir.join(format!("{VOCAB_FILE}.part"));
                    let write = || -> std::io::Result<()> {
                        std::fs::create_dir_all(&dir)?;
                        let f = std::fs::File::create(&part)?;
                        std::io::Write::write_all(&mut &f, &bytes)?;
                        f.set_len(file_size)?;
                        f.sync_all()?;
                        std::fs::rename(&part, &dest)
                    };
                    write().map_err(|e| unavailable(format!("{}: {e}", dest.display())))?;
                    return Ok(dest);
                }
                Err(why) => last = format!("from {}: {why}", &holder.to_string()[..12]),
            }
        }
        Err(unavailable(format!("this node holds no copy nor shard, and fetching the header failed ({last})")))
    }

    /// The header of `entry` from member `node` at `addr`, chunk by chunk; and the file's size.
    async fn header_from(
        &self,
        node: shoal_net::NodeId,
        addr: std::net::SocketAddr,
        entry: &shoal_types::CatalogEntry,
    ) -> Result<(Vec<u8>, u64), String> {
        use crate::api::{NodeRequest, NodeResponse, HEADER_CHUNK, MAX_HEADER};
        let conn = self.rt.node.connect(addr, node, shoal_net::alpn::NODE).await.map_err(|e| e.to_string())?;
        let mut bytes = Vec::new();
        loop {
            let req = NodeRequest::ModelHeader { model: entry.content_hash.clone(), offset: bytes.len() as u64 };
            let ask = async {
                let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
                shoal_membership::wire::write_msg(&mut send, &req).await.map_err(|e| e.to_string())?;
                let _ = send.finish();
                shoal_membership::wire::read_msg::<NodeResponse>(&mut recv)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| "no answer".to_string())
            };
            let answer = tokio::time::timeout(std::time::Duration::from_secs(30), ask)
                .await
                .map_err(|_| "no answer within 30 s".to_string())??;
            match answer {
                NodeResponse::Header { data_offset, file_size, bytes: chunk } => {
                    // What a member says is bounded before it is believed.
                    if data_offset > MAX_HEADER || data_offset > file_size || file_size != entry.size {
                        return Err(format!("an implausible header ({data_offset} of {file_size} bytes)"));
                    }
                    if chunk.is_empty() && (bytes.len() as u64) < data_offset || chunk.len() as u64 > HEADER_CHUNK {
                        return Err("a malformed header chunk".into());
                    }
                    bytes.extend_from_slice(&chunk);
                    if bytes.len() as u64 >= data_offset {
                        bytes.truncate(data_offset as usize);
                        conn.close(0u32.into(), b"done");
                        header_matches(entry, &bytes)?;
                        return Ok((bytes, file_size));
                    }
                }
                NodeResponse::Error(e) => return Err(e.message),
                other => return Err(format!("unexpected answer {other:?}")),
            }
        }
    }
}

/// The vocabulary-only file a node builds in the model's shard folder.
pub const VOCAB_FILE: &str = "vocab-only.gguf";

/// A node error as the API maps it to a status.
fn failure(e: ApiError) -> Failure {
    let kind = match e.kind {
        ErrorKind::BadRequest | ErrorKind::Refused | ErrorKind::Conflict => FailureKind::BadRequest,
        ErrorKind::Forbidden => FailureKind::Forbidden,
        ErrorKind::NotFound => FailureKind::NotFound,
        ErrorKind::Unavailable => FailureKind::Unavailable,
        ErrorKind::Busy => FailureKind::Busy,
    };
    Failure::new(kind, e.message)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the map leaves it whole (inserts are single calls).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fetched_header_must_be_the_one_the_catalog_names() {
        let header = b"GGUF and the rest of a header".to_vec();
        let mut entry = shoal_types::CatalogEntry {
            name: "m".into(),
            content_hash: "a".repeat(64),
            size: 1 << 20,
            arch: "llama".into(),
            n_layer: 2,
            context_length: 128,
            quantisation: "Q4_1".into(),
            layer_period: 1,
            holders: Default::default(),
            header_hash: Some(blake3::hash(&header).to_hex().to_string()),
        };
        assert_eq!(header_matches(&entry, &header), Ok(()));
        let mut forged = header.clone();
        forged[5] ^= 1;
        assert!(header_matches(&entry, &forged).unwrap_err().contains("other bytes"));
        // An entry from before headers were hashed: nothing to check against.
        entry.header_hash = None;
        assert_eq!(header_matches(&entry, &forged), Ok(()));
    }
}
